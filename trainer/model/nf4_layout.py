"""The NF4 layout's arithmetic (trainer.model.nf4 has the tensors): which block sizes a
weight quantizes with, whether it shards over a number of ranks, and its bytes. Pure,
so preflight and the planner use it on a laptop without torch.

A weight is a whole number of 64-value blocks; its block scales are double-quantized in
groups of up to 256 blocks, a group never wider than an eighth of the weight (so the
same weight quantizes the same way on any world size), and each rank's row chunk must
hold whole groups.
"""

from __future__ import annotations

BLOCK = 64
"""Values per NF4 block (one scale each), as bitsandbytes' and torchao's default."""
SCALER_BLOCK = 256
"""Block scales per double-quantization group, at most."""
MIN_GROUPS = 8
"""A weight has at least this many scale groups (tiny models use smaller groups)."""


def block_sizes(rows: int, cols: int) -> tuple[int, int]:
    """(block size, scaler block size) for a rows × cols weight, independent of the world
    size, so a resume on another world size dequantizes to the very same base."""
    n_blocks = rows * cols // BLOCK
    s = SCALER_BLOCK
    while s > 1 and n_blocks % (s * MIN_GROUPS):
        s //= 2
    return BLOCK, s


def shard_problem(rows: int, cols: int, dp: int) -> str | None:
    """Why a rows × cols NF4 weight cannot be sharded over `dp` ranks, or None."""
    numel = rows * cols
    if numel % BLOCK:
        return f"{rows}×{cols} is not a whole number of {BLOCK}-value NF4 blocks"
    _, s = block_sizes(rows, cols)
    n_blocks = numel // BLOCK
    if rows % dp:
        return f"its {rows} rows do not split evenly over {dp} ranks"
    if n_blocks % s or (n_blocks // dp) % s or (n_blocks // s) % dp:
        return (
            f"its {n_blocks} blocks do not split into {dp} shards of whole {s}-block scale groups"
        )
    return None


def quantized_nbytes(rows: int, cols: int) -> float:
    """Bytes of one NF4 weight: half a byte per value, a 1-byte scale per block, a 4-byte
    factor per scale group."""
    _, s = block_sizes(rows, cols)
    n_blocks = rows * cols / BLOCK
    return rows * cols / 2 + n_blocks + 4 * n_blocks / s
