"""`raylift report` and `status`: the planner's per-rank total beside what each rank
measured per phase (tools.jobcli.devicemem), from the records the worker stats write."""

from __future__ import annotations

import json

from tests.support.jobs import llama7b_job
from tools.jobcli.devicemem import device_memory_lines, measured
from tools.report import load_run, summary_lines
from trainer.config import load_config
from trainer.observability.device_memory import PHASES
from trainer.observability.workerstats import FIELDS

NODE = {"pool": "gpu-spot", "market": "spot", "instance_type": "g5.xlarge", "first": 0, "last": 60}


def _record(step: int, ranks: list[dict[str, float]]) -> dict:
    rec = {"step": step, "time": float(step), "loss": 1.0, "tokens_per_s": 1.0}
    rec["tokens_seen"] = 512 * step
    for p in PHASES:
        rec[f"dev_{p}_gib_max"] = max(r.get(p, 0.0) for r in ranks)
    rec["per_rank"] = {f"dev_{p}_gib": [r.get(p, 0.0) for r in ranks] for p in PHASES}
    return rec


def test_every_phase_field_is_gathered_per_rank():
    assert {f"dev_{p}_gib" for p in PHASES} <= set(FIELDS)


def test_planned_beside_measured_per_rank(tmp_path):
    cfg = load_config(llama7b_job(tmp_path), ["strategy.name=fsdp", "scaling.num_workers=2"])
    job = {"config": cfg.model_dump(mode="json"), "params": 6_738_415_616}
    steps = [
        _record(1, [{"load": 3.0, "first_step": 9.0}, {"load": 2.5, "first_step": 8.0}]),
        _record(2, [{"load": 3.0, "first_step": 9.0, "steady_step": 9.5, "checkpoint": 9.2},
                    {"load": 2.5, "first_step": 8.0, "steady_step": 8.5}]),
    ]  # fmt: skip
    per_rank, top = measured(steps)
    assert per_rank[0]["steady_step"] == 9.5 and per_rank[1]["checkpoint"] == 0.0
    assert top["steady_step"] == 9.5
    lines = device_memory_lines(job, [NODE], steps)
    assert lines[0].startswith("memory: planned ") and "(g5.xlarge: tensors " in lines[0]
    assert "context" in lines[0] and "slack" in lines[0]
    assert lines[1].startswith("memory: rank 0 measured peak 9.50 GiB (load 3.00, first step")
    assert "checkpoint 9.20" in lines[1] and "of plan" in lines[1]
    assert lines[2].startswith("memory: rank 1 measured peak 8.50 GiB")
    assert lines[3].endswith("within plan)")
    huge = [_record(1, [{"steady_step": 500.0}])]
    assert device_memory_lines(job, [NODE], huge)[-1].endswith("ABOVE PLAN)")
    assert device_memory_lines(job, [NODE], [{"step": 1}]) == []  # nothing measured


def test_report_prints_them_from_the_run_folder(tmp_path):
    cfg = load_config(llama7b_job(tmp_path), ["strategy.name=fsdp"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
    rec = _record(1, [{"load": 1.0, "first_step": 2.0}])
    (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    lines = summary_lines(load_run(str(run)))
    assert any(x.startswith("memory: planned ") for x in lines), lines
    assert any(x.startswith("memory: rank 0 measured peak 2.00 GiB") for x in lines), lines
