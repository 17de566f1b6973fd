"""Document attention over packed blocks: each token attends only to earlier tokens of its
own document, and positions restart at every document, so a packed block computes what
its documents would compute run one by one.

Restarted `position_ids` alone do not do it: with sdpa or eager attention, transformers
only restarts the rotary positions, and every token still sees the documents packed
before it. What does is a 4D block-causal mask, `[batch, 1, L, L]`, which transformers
passes to the attention kernel as is: a bool mask (True = may attend) for sdpa, and an
additive float mask (0 or the dtype's minimum) for eager, whose kernel adds the mask to
the scores (a bool mask there is silently wrong). The dense mask costs L² bytes per row
(bool) or 4·L² (float32): 4 MiB and 16 MiB per row at L = 2048, built once per micro
batch and shared by every layer; with a mask, sdpa on a GPU leaves its flash kernel for
the memory-efficient one.

flash_attention_2 (varlen over document boundaries) and flex attention's block mask take
the boundaries without a dense mask; neither is offered by this build (the images carry
no flash-attn, and `model.attn_implementation` resolves to sdpa or eager), so nothing here
can fall back to ignoring the mask.

A model with sliding-window attention keeps its window under document attention: a 4D
mask reaches the kernel as is, so the window is cut into it here (Mistral, Phi-3), and
a model with layers of both kinds (Gemma 2 and 3, Qwen2/3 with `layer_types`) gets one
mask per layer type, the mapping transformers' models take in place of a mask.
"""

from __future__ import annotations

from typing import Any

import torch

MODES = ("auto", "document", "causal")
SUPPORTED_IMPLS = ("sdpa", "eager")


def resolve(setting: str, chat_documents: int) -> str:
    """`data.attention` for a corpus: auto is document for conversations (chat and
    prompt/completion rows, where a stranger's conversation is noise the model would
    learn to condition on) and causal for plain text (GPT-style pretraining, where
    documents of one corpus share a domain and the full window is the cheaper default)."""
    if setting != "auto":
        return setting
    return "document" if chat_documents else "causal"


def position_ids(segs: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: 0 at every document start."""
    length = segs.shape[1]
    idx = torch.arange(length, device=segs.device).expand_as(segs)
    starts = torch.ones_like(segs, dtype=torch.bool)
    starts[:, 1:] = segs[:, 1:] != segs[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def block_causal_mask(
    segs: torch.Tensor, impl: str, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """`[batch, 1, L, L]`: query i may attend to key j when j ≤ i in the same document
    (and, with a sliding `window`, i - j < window, as transformers' own window mask)."""
    if impl not in SUPPORTED_IMPLS:
        raise ValueError(f"document attention needs sdpa or eager attention, not {impl}")
    length = segs.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segs.device).tril()
    if window is not None and window < length:
        causal = causal.triu(-(window - 1))
    allowed = (segs[:, :, None] == segs[:, None, :]) & causal
    allowed = allowed[:, None]
    if impl == "sdpa":
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segs.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def attention_inputs(
    segs: torch.Tensor | None,
    impl: str,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    per_layer_type: bool = False,
) -> dict[str, Any]:
    """The model's keyword arguments for a batch: nothing for causal attention (segs
    None), else the block-causal mask and restarted positions. `window`: the model's
    sliding window; `per_layer_type`: it has full and sliding layers, and takes a mask
    for each (trainer.model.attention says which)."""
    if segs is None:
        return {}
    if per_layer_type:
        mask: Any = {
            "full_attention": block_causal_mask(segs, impl, dtype),
            "sliding_attention": block_causal_mask(segs, impl, dtype, window),
        }
    else:
        mask = block_causal_mask(segs, impl, dtype, window)
    return {"attention_mask": mask, "position_ids": position_ids(segs)}


def mask_bytes(micro_batch_size: int, block_size: int, impl: str) -> int:
    """The dense mask's memory per micro batch (bool for sdpa, float32 for eager)."""
    return micro_batch_size * block_size * block_size * (1 if impl == "sdpa" else 4)
