"""Keep the planner's figures in the docs current: the paragraph of docs/production.md that
quotes `raylift plan` for the example 7B job is generated from the planner here, so it
cannot drift from the formula. `python -m tools.docgen.planfigures --write` rewrites it between
its markers; with no flag it prints it (tests/unit/planner/test_doc_figures.py compares)."""

from __future__ import annotations

import sys
from pathlib import Path

from tools.docgen.block import Block
from trainer.planner.memory import Setup
from trainer.planner.plan import Plan, plan
from trainer.planner.shape import GIB, LLAMA2_7B_CONFIG, ModelShape

PAGE = Path(__file__).resolve().parents[2] / "docs" / "production.md"
BEGIN = "<!-- planner figures (python -m tools.docgen.planfigures --write) -->"
END = "<!-- end of planner figures -->"

LLAMA2_7B = ModelShape.from_hf_config(LLAMA2_7B_CONFIG)
PRODUCTION_JOB = Setup(
    "fsdp", world=16, micro_batch=8, block_size=512, checkpointing=True, precision="bf16"
)
"""docs/production.md's example job: Llama-2-7B, FSDP over 16 workers, micro batch 8 × 512,
bf16, activation checkpointing."""


def production_plan() -> Plan:
    return plan(LLAMA2_7B, PRODUCTION_JOB, "g5.xlarge", rank0_instance="g5.12xlarge", search=False)


def production_paragraph() -> str:
    p = production_plan()
    r = p.rank

    def g(x: float) -> str:
        return f"{x / GIB:.1f}"

    return (
        "The planner agrees: `raylift plan job.yaml --instance g5.xlarge --rank0-instance\n"
        f"g5.12xlarge` puts it at {g(r.total)} GiB per GPU ({g(r.tensors - r.activations)} "
        f"sharded state with the layers in flight,\n{g(r.activations)} activations, "
        f"{g(r.overhead)} on the device beyond the tensors: CUDA context "
        f"{g(r.device['cuda_context'])}, "
        f"NCCL\n{g(r.device['nccl_buffers'])}, cuBLAS {g(r.device['cublas_workspaces'])}, "
        f"allocator slack {g(r.device['allocator_slack'])}), within the {1 - p.margin:.0%} of "
        "a 24 GiB A10G a fitting job may\nuse, against "
        f"{g(r.activations_no_ckpt)} GiB of activations alone without checkpointing."
    )


BLOCK = Block(PAGE, BEGIN, END, production_paragraph)
page = BLOCK.page


if __name__ == "__main__":
    sys.exit(BLOCK.main(sys.argv[1:], "planfigures"))
