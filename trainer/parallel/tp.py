"""Tensor-parallel plans for Hugging Face decoder layers.

Megatron's split: q/k/v and gate/up column-wise (each worker computes its share of heads
and of the MLP's hidden units), o and down row-wise (partial sums all-reduced once per
block), so a decoder layer costs two all-reduces of the hidden state in forward and two in
backward. Embeddings, norms and the LM head stay replicated over tp (FSDP shards them over
dp). Transformers 5's attention infers its local head count from the projection's output
width, so the attention module itself needs no change; heads and KV heads must divide by
tp (checked before launch by trainer.parallel.layout).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.errors import UserError

LLAMA_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""The plan for models whose config carries none (the Llama family's own plan)."""


def layer_plan(config: Any) -> dict[str, str]:
    """The per-decoder-layer plan: the model's own `base_model_tp_plan` entries under
    `layers.*.`, else the Llama plan. Only the colwise/rowwise styles are applied here."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    out = {k[len("layers.*.") :]: v for k, v in plan.items() if k.startswith("layers.*.")}
    if not out:
        return dict(LLAMA_PLAN)
    odd = sorted({v for v in out.values() if v not in ("colwise", "rowwise")})
    if odd:
        raise UserError(
            f"strategy.tp: {type(config).__name__}'s tensor-parallel plan uses styles "
            f"{odd} that this build does not apply (colwise/rowwise only); use tp: 1"
        )
    return out


def apply_tp(layers: list[torch.nn.Module], config: Any, tp_mesh: Any) -> None:
    """Split every decoder layer in `layers` over `tp_mesh` (in place, before FSDP)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = layer_plan(config)
    for layer in layers:
        styles = {
            name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
            for name, style in plan.items()
        }
        parallelize_module(layer, tp_mesh, styles)
