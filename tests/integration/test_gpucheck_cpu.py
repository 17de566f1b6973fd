"""`make gpu-check`'s CPU self-check: without CUDA, tools/gpucheck/ trains every
strategy (ddp, fsdp, fsdp + activation checkpointing, ZeRO-2, ZeRO-3, ZeRO-3 + CPU
offload, LoRA, QLoRA) in fp32 at tiny size on 2 gloo ranks under torchrun, through the
same loop, checkpoint, resume and export as on GPUs; so the GPU command cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.gpucheck import cases, jobs
from tools.gpucheck import mfu as gpucheck_mfu

pytestmark = pytest.mark.slow

ROOT = jobs.ROOT


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_cpu_self_check_trains_resumes_and_exports_every_strategy(ds_cpu_adam, tmp_path):
    out = tmp_path / "gpucheck"
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpucheck", "--out", str(out), "--cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "The GPU run is still to be done" in done.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["gpu"] is False and report["gpu_run_done"] is False and report["passed"]
    rows = {r["strategy"]: r for r in report["results"]}
    assert sorted(rows) == sorted(cases.STRATEGIES)
    # The MFU case (tools/gpucheck/mfu.py): Raylift's step alone at the Llama-3-8B shape,
    # shrunk on CPU to one layer of 64 with a 32,000 vocabulary; no resume or export.
    mfu = rows.pop(gpucheck_mfu.CASE)
    assert mfu["kind"] == "mfu" and mfu["problems"] == [] and mfu["layers"] == 1, mfu
    assert len(mfu["losses"]) == cases.CPU_SIZE.steps and mfu["tokens_per_s"] > 0, mfu
    assert mfu["mfu"] is None and mfu["size"]["vocab"] == 32000, mfu
    assert "MFU at Llama-3-8B shape (1 of 32 layers" in done.stdout
    for name, r in rows.items():
        assert r["problems"] == [], (name, r["problems"])
        assert r["world"] == 2 and len(r["losses"]) == cases.CPU_SIZE.steps, name
        assert r["losses"][-1] < r["losses"][0], name
        assert r["resumed_from"] == r["stop_at"] == cases.CPU_SIZE.steps // 2, name
        assert r["export_ok"] and r["tokens_per_s"] > 0 and r["mfu"] is None, name
        assert len(r["per_rank"]) == 2 and all(x["peak_rss"] > 0 for x in r["per_rank"]), name
    # Beside each full fine-tuning strategy, the framework's own bare loop on the same model
    # and batch (tools/gpucheck/bare.py): the ratio is printed, not judged on CPU.
    from tools.gpucheck.bare import FRAMEWORKS

    for name, r in rows.items():
        if name in FRAMEWORKS:
            assert r["bare_tokens_per_s"] > 0 and r["vs_bare"] > 0, name
        else:
            assert r["vs_bare"] is None, name
    assert "÷bare" in done.stdout
    # The table names every strategy once, and the PNG is written beside the JSON.
    table = done.stdout[done.stdout.index("strategy") :]
    assert all(f" {name} " in table for name in cases.STRATEGIES)
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    # raylift report on one of these CPU runs: the planner's per-rank figure beside what
    # each rank measured per phase (issue 47), from the metrics the run wrote.
    from tools.report import load_run, summary_lines

    lines = summary_lines(load_run(str(out / "runs" / "2x-ddp" / "gpucheck-ddp")))
    mem = [x for x in lines if x.startswith("memory: ")]
    assert mem[0].startswith("memory: planned ") and "host RAM per CPU rank" in mem[0], mem
    for r in (0, 1):
        line = next(x for x in mem if x.startswith(f"memory: rank {r} measured peak "))
        for phase in ("load ", "first step ", "steady ", "export "):
            assert phase in line, line
        assert "of plan" in line, line
