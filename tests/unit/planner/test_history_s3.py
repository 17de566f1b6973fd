"""`raylift plan` on a job whose storage is s3:// reads the past runs there (issue 47),
against the session's SeaweedFS: the same evidence as a local storage path gives the same
margin; storage it cannot reach is said in one line and the plan goes on without it."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.jobs import llama7b_job
from trainer.config import load_config
from trainer.planner.memory import Setup, rank_memory
from trainer.planner.shape import ModelShape

GIB = 1024**3
SETS = ["strategy.name=fsdp", "scaling.num_workers=16", "model.gradient_checkpointing=true"]


def _plan(job, capsys) -> dict:
    from trainer.__main__ import main

    args = ["plan", str(job), "--instance", "g5.xlarge", "--json"]
    args += [x for s in SETS for x in ("--set", s)]
    assert main(args) in (0, 2)
    return json.loads(capsys.readouterr().out)


def test_plan_reads_past_runs_under_s3_storage(tmp_path, s3_server, capsys):
    prefix = f"history-{uuid.uuid4().hex[:8]}/runs"
    storage = {"path": f"s3://{s3_server['bucket']}/{prefix}"}
    job = llama7b_job(tmp_path, storage={**storage, "endpoint_override": s3_server["endpoint"]})
    cfg = load_config(job, SETS)
    shape = ModelShape.from_hf_config(json.loads((tmp_path / "model" / "config.json").read_text()))
    planned = rank_memory(shape, Setup.from_config(cfg), "A10G").total
    assert _plan(job, capsys)["margin"] == 0.05  # no history yet

    client, bucket = s3_server["client"], s3_server["bucket"]

    def put(key: str, body: dict) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=json.dumps(body).encode())

    def past(name: str, ratio: float, gpu: str = "NVIDIA A10G") -> None:
        put(f"{name}/job.json", {"config": cfg.model_dump(mode="json")})
        peak = {"rank": 0, "kind": "cuda", "device": gpu}
        peak["dev_steady_step_gib"] = ratio * planned / GIB
        put(f"{name}/device_memory/rank0.json", peak)

    past("under", 0.9)
    past("over", 1.2)
    past("other-gpu", 2.0, gpu="NVIDIA H200")  # another GPU kind: not this plan's evidence
    put("no-record/device_memory/rank0.json", {"kind": "cuda", "device": "NVIDIA A10G"})
    out = _plan(job, capsys)
    assert out["margin"] == pytest.approx(0.2)
    assert out["margin_why"] == "past fsdp runs measured above plan"
    assert out["history"][0].startswith("history: 2 past fsdp run(s) on A10G")
    assert "from 0.90 to 1.20" in out["history"][0]
    assert "over: planned" in out["history"][1]
    # The calibration file beside the runs is read from S3 too: its fsdp error (0.3) is now
    # the larger reason for the margin.
    from trainer.planner import calibration as C

    cal = C.Calibration(
        gpu_name="NVIDIA A10G",
        gpu_model="A10G",
        torch="2.13.0+cu130",
        cuda="13.0",
        nccl="2.28.3",
        date="2026-11-29",
        context_bytes=700 * 2**20,
        strategies={"fsdp": C.StrategyCalibration(slack_fraction=0.1, error=0.3)},
    )
    put("_calibration/A10G.json", cal.to_dict())
    out = _plan(job, capsys)
    assert out["margin"] == pytest.approx(0.3)
    assert out["margin_why"] == "fsdp's error in the calibration"
    assert out["history"][0].startswith("history: 2 past fsdp run(s) on A10G")


def test_s3_storage_that_cannot_be_read_is_one_line_and_no_history(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    job = llama7b_job(tmp_path, storage={"path": "s3://ckpt/runs", "endpoint_override": dead})
    out = _plan(job, capsys)
    assert out["margin"] == 0.05
    assert len(out["history"]) == 1, out["history"]
    assert out["history"][0].startswith("history: s3://ckpt/runs: past runs not read: ")
