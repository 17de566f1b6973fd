"""Keep the simulator's figures in the docs current: the table of docs/checkpoints.md that
says what a 64-node, 3-day 7B run on g5 spot should expect is generated here from
`trainer.planner.faults_sim` (the planner's plan for the job, the cadence's priors, the
seeded Monte Carlo `raylift plan --days 3 --nodes 64` prints), so a change to the rule,
the priors or the catalog that moves a figure fails tests/unit/planner/test_cadence_figures.py
until the page is rewritten. `python -m tools.docgen.cadencefigures --write` rewrites it
between its markers; with no flag it prints it."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools.docgen.block import Block
from trainer.config import JobConfig
from trainer.planner import faults_sim as fs
from trainer.planner.cadence import SPOT_BANDS
from trainer.planner.catalog import get_instance
from trainer.planner.plan import plan_job
from trainer.planner.shape import LLAMA2_7B_CONFIG

PAGE = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"
BEGIN = "<!-- simulated 64-node run (python -m tools.docgen.cadencefigures --write) -->"
END = "<!-- end of simulated 64-node run -->"

NODES, DAYS, SEED = 64, 3.0, 0
INSTANCES = ("g5.xlarge", "g5.4xlarge")
OLD_DEFAULTS = "memory_every off, every_steps end only"
"""faults_sim.FIXED's first entry: what checkpoint.every_steps / memory_every defaulted to
before `auto` (null and 0)."""


def job(model_dir: Path) -> JobConfig:
    """The page's job: a full fine-tune of Llama-2-7B with FSDP over 64 GPUs, micro batch
    4 × grad accumulation 4 × 512 tokens, bf16, the checkpoint defaults (auto)."""
    return JobConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_file": "/mnt/efs/data/train.jsonl", "block_size": 512},
            "strategy": {"name": "fsdp"},
            "train": {"precision": "bf16", "micro_batch_size": 4, "grad_accum": 4},
            "scaling": {"num_workers": NODES, "use_gpu": True},
            "storage": {"path": "s3://my-bucket/runs"},
            "run": {"name": "llama7b-64-spot"},
        }
    )


def rows() -> list[dict[str, Any]]:
    """One row per instance type: the scenario and the simulator's outcomes."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama-2-7b"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG))
        cfg = job(model)
        for instance in INSTANCES:
            s = fs.scenario_for_plan(cfg, plan_job(cfg, instance), DAYS, NODES)
            assert s is not None, instance
            m, k = fs.auto_intervals(s)
            got = fs.compare(s, SEED)
            got["auto"] = fs.simulate(s, m, k, SEED)  # compare's 200 trials, named
            out.append({"instance": instance, "scenario": s, "outcomes": got})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def table() -> str:
    rs = rows()
    s0 = rs[0]["scenario"]
    lines = [
        "A full fine-tune of Llama-2-7B with FSDP on 64 g5 spot nodes for 3 days (micro batch 4,",
        f"grad accumulation 4, block 512, bf16; the planner's {s0.step_s:.1f} s step at its "
        "default MFU), as",
        "the simulator figures it (200 seeded runs each; these are simulator figures, not",
        "measurements):",
        "",
        "| 64 × g5 spot, 3 days | auto intervals | goodput (p10) | faults + checkpoints cost "
        "| the old defaults (storage only at the end) |",
        "|---|---|---|---|---|",
    ]
    for r in rs:
        s, o = r["scenario"], r["outcomes"]
        auto, old = o["auto"], o[OLD_DEFAULTS]
        gib = get_instance(r["instance"]).ram_gib
        where = (
            f"{gib:.0f} GiB RAM: RAM tier on"
            if s.memory_tier
            else f"{gib:.0f} GiB RAM: keepers do not fit, storage alone"
        )
        if auto.memory_every and auto.memory_every == auto.storage_every:
            chosen = f"RAM tier and storage every {auto.storage_every} steps"
        elif auto.memory_every:
            chosen = f"RAM tier every {auto.memory_every}, storage every {auto.storage_every} steps"
        else:
            chosen = f"storage every {auto.storage_every} steps"
        lines.append(
            f"| {r['instance']} ({where}) | {chosen} | {_pct(auto.goodput)} "
            f"({_pct(auto.goodput_p10)}) | ${auto.usd_lost:,.0f} of ${auto.usd:,.0f} | "
            f"{_pct(old.goodput)} (p10 {_pct(old.goodput_p10)}), ${old.usd_lost:,.0f} |"
        )
    fails = rs[0]["outcomes"]["auto"].failures_per_day
    band = SPOT_BANDS[get_instance(rs[0]["instance"]).spot_interruption_band]
    on = next(r for r in rs if r["scenario"].memory_tier)
    every_step = fs.simulate(on["scenario"], 1, on["outcomes"]["auto"].storage_every, SEED)
    stall = on["outcomes"]["auto"].goodput - every_step.goodput
    lines += [
        "",
        f"About {fails:.1f} failures a day are expected at the assumed band (64 nodes × "
        f"{100 * band:g} % a month,",
        "most of them drained); what decides the bill is having periodic checkpoints at all and",
        "not stalling on them: a snapshot every step (`memory_every: 1`) would cost "
        f"{_pct(stall)} of the",
        f"run on {on['instance']}. A higher band or more nodes move the same table: rerun the "
        "command. The table",
        "is generated (`python -m tools.docgen.cadencefigures --write`), and a unit test fails "
        "when the",
        "simulator, the rule, the priors or the catalog move a figure until it is rewritten.",
    ]
    return "\n".join(lines)


BLOCK = Block(PAGE, BEGIN, END, table)
page = BLOCK.page


if __name__ == "__main__":
    sys.exit(BLOCK.main(sys.argv[1:], "cadencefigures"))
