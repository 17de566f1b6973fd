"""Pipeline stages cut from a whole Hugging Face causal LM, and their schedules.

torchtitan's way: build the whole model (on the meta device, so it costs nothing), then
keep only the stage's decoder layers, in an `nn.ModuleDict` keyed by their original index,
and drop `embed_tokens`, `norm` and `lm_head` where the stage does not own them. Parameter
names stay the Hugging Face ones ("model.layers.7.mlp.up_proj.weight"), which is what lets
a checkpoint written under one (dp, pp, tp) layout load under another, and the export be a
plain HF folder. Each stage recomputes the rotary (cos, sin) from the positions: only the
hidden state travels between stages. With the chunked loss (train.loss auto or chunked) the
last stage ends at its final norm and the schedule's loss function runs its lm_head with
the labels (`last_stage_loss`), so no stage ever holds a micro batch's whole logits.

Families whose causal LM is `model.{embed_tokens, layers, norm, rotary_emb}` + `lm_head`
and whose layers take `position_embeddings=` work: Llama, Mistral, Qwen2, Qwen3, Phi-3
(trainer.model.families marks them). Gemma 2 and 3 do not: they scale the embeddings,
soft-cap the logits and tie lm_head to the first stage's embeddings; preflight refuses
them in one line.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from trainer.errors import UserError
from trainer.model import families
from trainer.objectives import linear_ce

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}
FAMILIES = tuple(k for k, f in families.FAMILIES.items() if f.pipeline)


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds: one, or two for the interleaved schedules (loop
    order, stage r and r + pp) and ZB-V (V order, stage r and 2pp - 1 - r)."""
    if per_rank == 1:
        return [pp_rank]
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def layer_ids(n_layers: int, n_stages: int, stage: int) -> list[int]:
    per = n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def cut_to_stage(model: torch.nn.Module, stage: int, n_stages: int) -> torch.nn.Module:
    """Cut a whole (meta-device) HF causal LM down to `stage` of `n_stages`, in place, and
    give it the stage's forward: token ids or a hidden state in, a hidden state or (on the
    last stage) logits out."""
    if getattr(model.config, "model_type", None) not in FAMILIES:
        raise UserError(
            f"strategy.pp: {type(model).__name__} is not a family the pipeline stage builder "
            f"knows ({', '.join(FAMILIES)}); use pp: 1"
        )
    inner = model.model
    keep = layer_ids(len(inner.layers), n_stages, stage)
    inner.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in keep})
    if stage != 0:
        inner.embed_tokens = None
    if stage != n_stages - 1:
        inner.norm = None
        model.lm_head = None
    model.forward = types.MethodType(_stage_forward, model)
    return model


def _stage_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    inner = self.model
    h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    masks = _causal_masks(self.config, h, positions)
    types = getattr(self.config, "layer_types", None)
    rotary = inner.rotary_emb(h, position_ids=positions)
    for i, layer in inner.layers.items():
        mask = masks[types[int(i)] if types else "full_attention"]
        h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    if inner.norm is not None:
        h = inner.norm(h)
    if self.lm_head is not None and not gives_hidden(self):
        h = self.lm_head(h)
    return h


def gives_hidden(part: Any) -> bool:
    """Whether this stage ends in the chunked loss's head (trainer.objectives.linear_ce):
    then the last stage hands on its normed hidden states, never the whole logits, and
    `last_stage_loss` makes the loss from them a chunk at a time."""
    return isinstance(getattr(part, "lm_head", None), linear_ce.LinearCEHead)


def last_stage_loss(
    part: Any, out: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor
) -> torch.Tensor:
    """The last stage's loss: its targets' summed cross-entropy over `divisor`. With the
    chunked loss `out` is the hidden state and the loss is made inside lm_head's call (so
    FSDP2's root, which has kept lm_head unsharded since the stage's forward, sees the
    weight it gathered, and the weight's gradient lands where FSDP2 reduces it)."""
    if gives_hidden(part):
        return part.lm_head(out, labels=labels, num_items_in_batch=divisor)
    return token_loss_sum(out, labels) / divisor


def stage_logits(part: Any, out: torch.Tensor) -> torch.Tensor:
    """The logits of the last stage's output (its hidden states, with the chunked loss)."""
    if not gives_hidden(part):
        return out
    with torch.no_grad():
        return part.lm_head(out)


def _causal_masks(config: Any, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The causal mask of each layer type, as the whole model builds them: None with sdpa
    (its is_causal path), an explicit mask with eager (where None would mean no mask);
    a sliding window where the model has one (Mistral and Phi-3 on every layer, Qwen2/3
    on the layers its layer_types name)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = {
        "config": config,
        "inputs_embeds": h,
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": positions,
    }
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    full = create_sliding_window_causal_mask if window and not types else create_causal_mask
    masks = {"full_attention": full(**kw)}
    if "sliding_attention" in types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
    return masks


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the targets that are not ignored (-100), the
    shift done as Hugging Face's causal-LM loss does it."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shifted.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def build_schedule(
    name: str, stages: list[Any], n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> Any:
    """A torch.distributed.pipelining schedule over this rank's stages. Losses are sums
    over a global target count, so gradients must not be rescaled by the number of
    microbatches (scale_grads=False): the loss is the token mean of the global batch even
    when microbatches hold different numbers of targets."""
    from torch.distributed import pipelining

    cls = getattr(pipelining, SCHEDULES[name])
    first = stages[0] if len(stages) == 1 else stages
    return cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
