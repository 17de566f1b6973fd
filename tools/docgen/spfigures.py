"""Keep docs/planning.md's long-context table current: Llama-2-7B and Llama-3-8B at 32k and
128k tokens on one g5.48xlarge (8 A10G), per sequence-parallel size, computed by the
planner (trainer.planner.sequence through rank_memory and the plan's verdict).
`python -m tools.docgen.spfigures --write` rewrites the block between its markers; with
no flag it prints it (tests/unit/planner/test_sp_plan.py compares)."""

from __future__ import annotations

import sys
from pathlib import Path

from tools.docgen.block import Block
from trainer.planner.memory import Setup
from trainer.planner.plan import plan
from trainer.planner.sequence import candidates
from trainer.planner.shape import GIB, LLAMA2_7B_CONFIG, ModelShape

PAGE = Path(__file__).resolve().parents[2] / "docs" / "planning.md"
BEGIN = "<!-- long-context figures (python -m tools.docgen.spfigures --write) -->"
END = "<!-- end of long-context figures -->"

MODELS = {
    "Llama-2-7B": ModelShape.from_hf_config(LLAMA2_7B_CONFIG),
    "Llama-3-8B": ModelShape(4096, 32, 32, 8, 14336, 128256, model_type="llama"),
}
"""Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256."""
LENGTHS = (32768, 131072)
INSTANCE = "g5.48xlarge"


def long_context_job(block_size: int, sp: int) -> Setup:
    """FSDP2 over 8 workers, micro batch 1, bf16, activation checkpointing, chunked loss."""
    return Setup(
        "fsdp",
        world=8,
        micro_batch=1,
        block_size=block_size,
        checkpointing=True,
        precision="bf16",
        loss="auto",
        sp=sp,
    )


def rows() -> list[tuple[str, int, int, float, float, str]]:
    """(model, block, sp, GiB a rank, of which activations, verdict) for every sp the
    model's KV heads allow on 8 workers."""
    out = []
    for name, shape in MODELS.items():
        for block in LENGTHS:
            for sp in candidates(shape, long_context_job(block, 1)):
                p = plan(shape, long_context_job(block, sp), INSTANCE, search=False)
                verdict = p.layout.verdict if p.layout else "?"
                out.append((name, block, sp, p.rank.total / GIB, p.rank.activations / GIB, verdict))
    return out


def table() -> str:
    lines = [
        "| model | block | sp | per rank | of which activations | on A10G (g5.48xlarge) |",
        "|---|---|---|---|---|---|",
    ]
    for name, block, sp, total, act, verdict in rows():
        k = f"{block // 1024}k"
        lines.append(f"| {name} | {k} | {sp} | {total:.1f} GiB | {act:.1f} GiB | {verdict} |")
    return "\n".join(lines)


BLOCK = Block(PAGE, BEGIN, END, table)
page = BLOCK.page


if __name__ == "__main__":
    sys.exit(BLOCK.main(sys.argv[1:], "spfigures"))
