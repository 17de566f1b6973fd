"""Sequence parallelism in the plan: what `strategy.sp` (trainer.parallel.sequence, Ulysses)
does to one rank's memory, and the smallest sp that fits.

Ulysses splits every token-wise activation over the sp ranks of a group: each rank keeps
micro_batch × block_size / sp tokens of every layer. Attention gets whole sequences
through an all-to-all that trades the sequence split for a head split, so what attention
saves for its backward (q, k, v of heads / sp over the whole sequence) has the same bytes
as the share's q, k, v had: the per-layer count does not change, only its token count.
What is new is the exchange itself: one layer at a time, the contiguous send buffer and
the receive buffer of q, k, v going in and of the output coming back, each c · (q_dim +
2 kv_dim) or c · q_dim per local token. They live inside one layer's attention. Without
activation checkpointing the step's peak is at the loss (every layer's activations saved,
the loss's buffers on top), so memory.activation_bytes counts the larger of the two, not
their sum: measured (tests/bench/test_bench_sp.py, 4096 tokens, CPU) the sum put sp 4 13 %
above the peak, the larger 9 %. With checkpointing a layer rebuilt in backward exchanges
again beside the rebuilt layer, and both are counted (not measured yet). With eager
attention, each rank's fp32 scores are heads / sp × block_size² per row: per local token,
heads × block_size, as before.

Pure Python (the laptop's planner): no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from trainer.planner.setup import Setup
from trainer.planner.shape import ModelShape

OBJECTIVES = ("sft", "dpo", "ipo", "hinge", "simpo", "orpo")
"""The objectives trainer.config accepts with strategy.sp > 1 (exact: trainer.parallel.
sequence). A pair is two sequences: `Setup.micro_batch` counts both, so a rank's share of
the tokens, its activations and the all-to-all's buffers are a preference job's too."""


def local_tokens(s: Setup) -> int:
    """Tokens of a micro batch one rank holds activations for."""
    return s.micro_batch * s.block_size // max(1, s.sp)


def exchange_bytes(shape: ModelShape, s: Setup) -> float:
    """The all-to-all's transient buffers of one layer (0 without sequence parallelism):
    send and receive copies of q, k, v in, and of the attention output back."""
    if s.sp <= 1:
        return 0.0
    per_token = s.c * (shape.q_dim + 2 * shape.kv_dim + shape.q_dim)
    return float(2 * local_tokens(s) * per_token)


def candidates(shape: ModelShape, s: Setup) -> list[int]:
    """The sp a job could run with, smallest first: it divides the workers, the block,
    the KV heads and the attention heads (trainer.config and trainer.parallel.layout
    refuse the rest)."""
    out = []
    for sp in range(1, s.world + 1):
        if s.world % sp or s.block_size % sp or shape.kv_heads % sp or shape.heads % sp:
            continue
        out.append(sp)
    return out


def smallest_fitting(
    shape: ModelShape, s: Setup, fits: Callable[[Setup], bool]
) -> tuple[Setup, bool]:
    """The Setup with the smallest sp for which `fits` holds, and True; else the largest
    sp tried (the least memory), and False."""
    tried = s
    for sp in candidates(shape, s):
        tried = replace(s, sp=sp)
        if fits(tried):
            return tried, True
    return tried, False
