"""Trainer overhead: tokens/s of the Raylift loop against a bare torch DDP loop, same
model, same batch, 2 gloo workers, side by side in one run. Target: ≥ 0.95 of bare.

The Raylift loop runs twice: under torchrun, and submitted to a local Ray cluster (the
production path, Ray Train V2). All are timed the same way: wall-clock over the steps
after the first 20% (warm-up excluded), so everything the Raylift loop does per step
(metrics all-reduce, metrics file, logging, the time-gated ray.train.report) is inside
the measurement.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from tests.bench.benchutil import bar_chart, write_result
from tests.helpers import torchrun
from tools.tiny import build_all
from trainer.metrics import read_records
from trainer.storage import resolve

STEPS, BLOCK, MICRO = 120, 128, 8
# Steps between metric records and log lines (RAYLIFT_BENCH_LOG_EVERY to compare).
LOG_EVERY = int(os.environ.get("RAYLIFT_BENCH_LOG_EVERY", "1"))
HERE = Path(__file__).resolve().parent


def _torchrun(args: list[str]) -> None:
    res = torchrun(args)
    assert res.returncode == 0, res.stderr[-3000:]


def _steady_tps(records: list[dict]) -> float:
    steps = [r for r in records if r.get("event") == "train"]
    steady = steps[len(steps) // 5 :]
    tokens = steady[-1]["tokens_seen"] - steady[0]["tokens_seen"]
    return tokens / (steady[-1]["time"] - steady[0]["time"])


def test_trainer_overhead(tmp_path):
    assets = build_all(tmp_path / "assets", rows=20000, hidden=256, layers=4)
    job = {
        "model": {"path": str(assets["model"]), "special_tokens": str(assets["tokens"])},
        "data": {"train_file": str(assets["train"]), "block_size": BLOCK},
        "train": {"micro_batch_size": MICRO, "max_steps": STEPS, "log_every": LOG_EVERY},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "scaling": {"num_workers": 2},
        "storage": {"path": str(tmp_path / "runs")},
        "run": {"name": "overhead"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    _torchrun(["-m", "trainer", "run", str(path)])
    raylift = _steady_tps(
        read_records(resolve(str(tmp_path / "runs")).join("overhead", "metrics.jsonl"))
    )

    # The production path: the same job submitted to a local Ray cluster (Ray Train V2).
    from tools import submit
    from tools.localcluster import LocalCluster
    from trainer.config import load_config

    with LocalCluster(num_cpus=2) as cluster:
        cfg = load_config(path, ["run.name=overhead-ray"])
        client, job_id = submit.submit(cfg, cluster.dashboard_url, token=cluster.token)
        status, _ = submit.follow(client, job_id, progress=False)
        assert status == "SUCCEEDED", client.get_job_logs(job_id)[-3000:]
    raylift_ray = _steady_tps(
        read_records(resolve(str(tmp_path / "runs")).join("overhead-ray", "metrics.jsonl"))
    )

    cache = next((assets["train"].parent / ".raylift-cache").iterdir())
    meta = json.loads((cache / "meta.json").read_text())
    out = tmp_path / "bare.json"
    _torchrun(
        [
            str(HERE / "bare_ddp.py"),
            str(assets["model"]),
            str(cache / "tokens.bin"),
            meta["dtype"],
            str(BLOCK),
            str(MICRO),
            str(STEPS),
            str(out),
            str(meta["vocab_size"]),
        ]
    )
    bare = json.loads(out.read_text())["tokens_per_s"]

    ratio = raylift / bare
    ratio_ray = raylift_ray / bare
    write_result(
        "overhead",
        {
            "raylift_torchrun_tokens_per_s": raylift,
            "raylift_ray_train_tokens_per_s": raylift_ray,
            "bare_ddp_tokens_per_s": bare,
            "ratio": ratio,
            "ratio_ray_train": ratio_ray,
            "target_ratio": 0.95,
            "meets_target": min(ratio, ratio_ray) >= 0.95,
            "setup": {
                "workers": 2,
                "backend": "gloo",
                "block_size": BLOCK,
                "micro_batch": MICRO,
                "steps": STEPS,
                "log_every": LOG_EVERY,
                "model": "Llama hidden 256, 4 layers, fp32, CPU",
            },
        },
    )
    bar_chart(
        "overhead",
        f"Trainer overhead (torchrun {ratio:.3f}, Ray {ratio_ray:.3f})",
        ["raylift torchrun", "bare DDP", "raylift on Ray"],
        [raylift, bare, raylift_ray],
        "tokens/s (2 workers)",
    )
