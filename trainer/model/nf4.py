"""QLoRA's frozen base under FSDP2: torchao's NF4 tensors, sharded like any parameter.

bitsandbytes' `Params4bit` does not survive FSDP2 (its `quant_state` is dropped and stays
replicated, and mixed precision silently corrupts it), and `from_pretrained` with a
`BitsAndBytesConfig` quantizes the whole model on every rank. torchao's `NF4Tensor` has
FSDP2's all-gather hooks: its 4-bit data, its block scales and their double-quantization
factors are all sharded along dim 0, gathered per layer for the forward, and dequantized
to the compute dtype inside the matmul. So QLoRA on FSDP2 keeps the base in NF4 (the
same 4-bit normal-float code as bitsandbytes' nf4, double-quantized scales) while DDP
keeps bitsandbytes.

Loading never holds the whole base on one rank: the skeleton's NF4 weights are on the
meta device; each target weight is read (memory-mapped) in full, quantized, cut to this
rank's chunk and assigned, one tensor at a time (torchtune's way: copying into a
`to_empty` NF4 shard does not work).

The shape rules (block sizes, what shards over how many ranks) are pure arithmetic in
trainer.model.nf4_layout, which preflight and the planner use without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainer.model.nf4_layout import block_sizes

# ------------------------------------------------------------------ torch side


def is_nf4(t: Any) -> bool:
    """A torchao NF4 tensor, or a DTensor whose shard is one."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return type(local).__name__ == "NF4Tensor"


def quantize_skeleton(model: Any, dtype: Any, skip: set[str]) -> list[str]:
    """Replace the weight of every frozen Linear of a meta skeleton (after PEFT: the LoRA
    base layers and the untargeted ones alike, as bitsandbytes' 4-bit load does) by an
    NF4 tensor of `dtype` (meta too; it only fixes the shapes FSDP shards), except the
    modules named in `skip` (the output embedding). Returns the quantized weights' names."""
    import torch

    try:
        from torchao.quantization import to_nf4
    except ImportError:
        from trainer.errors import UserError

        raise UserError(
            "model.adapter qlora with strategy fsdp: torchao is not installed "
            "(use the trainer image)"
        ) from None
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or skip & set(name.split(".")):
            continue
        w = module.weight
        if w.requires_grad or w.dim() != 2:
            continue
        bs, sbs = block_sizes(*w.shape)
        module.weight = torch.nn.Parameter(to_nf4(w.to(dtype), bs, sbs), requires_grad=False)
    return [n for n, p in model.named_parameters() if is_nf4(p)]


def load_sharded(
    model: Any, names: list[str], full: Callable[[str], Any], device: Any
) -> Mapping[str, int]:
    """Fill the NF4 weights `names` of a fully_shard'ed model, one at a time: the full
    weight (`full(name)`, memory-mapped) is quantized, cut to this rank's rows and
    assigned. Returns the largest full weight's bytes (what one rank ever held at once)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torchao.quantization import to_nf4

    params = dict(model.named_parameters())
    largest = 0
    for name in names:
        p = params[name]
        local = p.to_local() if isinstance(p, DTensor) else p
        w = full(name).to(device=device, dtype=local.dtype).contiguous()
        largest = max(largest, w.numel() * w.element_size())
        q = to_nf4(w, local.block_size, local.scaler_block_size)
        del w
        if not isinstance(p, DTensor):  # not sharded (one replica): the whole weight
            model.load_state_dict(
                {name: torch.nn.Parameter(q, requires_grad=False)}, strict=False, assign=True
            )
            continue
        mesh = p.device_mesh
        chunk = torch.chunk(q, mesh.size(), dim=0)[mesh.get_local_rank()]
        shard = q.new_zeros(chunk.size())
        shard.copy_(chunk)
        del q, chunk
        sharded = DTensor(shard, p._spec, requires_grad=False)
        model.load_state_dict(
            {name: torch.nn.Parameter(sharded, requires_grad=False)}, strict=False, assign=True
        )
    return {"largest_full_weight": largest}


def inner_tensors(t: Any) -> list[Any]:
    """The plain tensors inside an NF4 tensor (for memory accounting)."""
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]
