"""Trainer overhead: tokens/s of the Raylift loop against a bare torch DDP loop, same
model, same batch, 2 gloo workers. Targets: under torchrun, ≥ 0.97 of bare: DDP through
the strategy seam stays within 3% of the old DDP path (issue 8). The old path is gone;
the bare loop (tests/bench/bare_ddp.py: load, wrap in DDP, forward, backward, clip, step)
is what it did minus all bookkeeping, so it is the stricter, fair stand-in. Submitted to
a local Ray cluster (the production path, Ray Train V2), ≥ 0.95 of bare: that ratio also
carries Ray Train's own per-worker costs, which are not the seam's.

The three commands run interleaved (Raylift torchrun, bare, Raylift on Ray, then again),
and each ratio is taken within a round, so load from other processes on the machine hits
both sides of a ratio alike. All three are timed the same way: wall-clock over the steps
after the first 20% (warm-up excluded), so everything the Raylift loop does per step
(metrics all-reduce, metrics file, logging, the time-gated ray.train.report) is inside the
measurement. The data is tokenized once, before the first round, and the Ray cluster (the
test session's: a head and two 1-CPU nodes) stays up for all rounds (its start-up is not
what is measured).

Watching the run (issue 21): the Raylift runs always measure per-worker memory and step
phases and gather them once per logged step; `raylift_torchrun_watched` also logs every
record to MLflow (a sqlite store), W&B (offline) and TensorBoard from rank 0's background
senders. Target: ≥ 0.99 of the unwatched torchrun run, within the same round.

Where the cores went (no targets, reported to explain the ratios): psutil samples the
machine through every round, and each run reports the cores its training processes used
over its steady window (`train_cores`) and what everything else used meanwhile
(`other_cores`: Ray's own processes, the harness). `ray_train_per_train_cpu` is tokens
per training CPU-second, Ray Train against bare: the loop's own per-step costs under Ray
Train, whatever Ray's other processes take from the workers' cores. `ray_other_cores` is
how many more cores the rest of the machine used during the Ray Train run than during the
bare one (the cluster is up for both).

Sizes (for a quick run on a busy machine): RAYLIFT_BENCH_STEPS, RAYLIFT_BENCH_HIDDEN,
RAYLIFT_BENCH_LAYERS; RAYLIFT_BENCH_LOG_EVERY sets the steps between metric records;
RAYLIFT_BENCH_REPEATS the rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.bench.benchutil import (
    Check,
    CpuWatch,
    run_benchmark,
    size,
    smoke,
    steady_tokens_per_s,
    steady_window,
    torch_or_ray_worker,
    trainer_job,
)
from tests.support.torchrun import torchrun
from tools.tiny import build_all
from trainer.observability.metrics import read_records
from trainer.storage.location import resolve

# Minutes even at smoke size: make bench runs it, make test leaves it out (docs/development.md).
pytestmark = pytest.mark.bench_only

STEPS = size("RAYLIFT_BENCH_STEPS", 120, 10, minimum=10)
HIDDEN = size("RAYLIFT_BENCH_HIDDEN", 256, 64)
LAYERS = size("RAYLIFT_BENCH_LAYERS", 4, 2)
LOG_EVERY = size("RAYLIFT_BENCH_LOG_EVERY", 1, 1)
BLOCK, MICRO = 128, 8
ROWS = size("RAYLIFT_BENCH_ROWS", 20000, 2000)
SEAM_TARGET = 0.97  # issue 8: DDP through the seam within 3% of the old path
RAY_TARGET = 0.95
WATCH_TARGET = 0.99  # issue 21: trackers cost under 1% of tokens/s
HERE = Path(__file__).resolve().parent


def _torchrun(args: list[str]) -> None:
    res = torchrun(args)
    assert res.returncode == 0, res.stderr[-3000:]


def _ratio(raylift: str):
    return lambda r: r[raylift]["tokens_per_s"] / r["bare_ddp"]["tokens_per_s"]


def _per_train_cpu(run: dict[str, float]) -> float:
    return run["tokens_per_s"] / run["train_cores"]


def test_trainer_overhead(ray_cluster, tmp_path):
    from tools.jobcli import submit
    from tools.jobcli.follow import follow
    from trainer.config import load_config
    from trainer.model.loading import load_tokenizer
    from trainer.runtime.launch import prepare_inputs

    assets = build_all(tmp_path / "assets", rows=ROWS, hidden=HIDDEN, layers=LAYERS)
    runs = tmp_path / "runs"
    job = trainer_job(assets, runs, "overhead", STEPS, BLOCK, MICRO, LOG_EVERY)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    # Tokenize once, where the trainer will look for it, so no round pays for it and the
    # bare loop reads the very same tokens.
    cache = Path(prepare_inputs(load_config(path, []), progress=False).train_cache)
    vocab = len(load_tokenizer(assets["model"], str(assets["tokens"])))  # as the trainer sizes it

    cpu = CpuWatch(torch_or_ray_worker)

    def figures(tokens_per_s: float, window: tuple[float, float]) -> dict[str, float]:
        train, other = cpu.cores(*window)
        return {"tokens_per_s": tokens_per_s, "train_cores": train, "other_cores": other}

    def tps(run_name: str) -> dict[str, float]:
        records = read_records(resolve(str(runs)).join(run_name, "metrics.jsonl"))
        return figures(steady_tokens_per_s(records), steady_window(records))

    def raylift_torchrun(i: int) -> dict[str, float]:
        _torchrun(["-m", "trainer", "run", str(path), "--set", f"run.name=torchrun-{i}"])
        return tps(f"torchrun-{i}")

    watched = [
        "tracking.tensorboard=true",
        f"tracking.mlflow={{tracking_uri: 'sqlite:///{tmp_path / 'mlflow.db'}'}}",
        "tracking.wandb={project: bench, mode: offline}",
    ]

    def raylift_torchrun_watched(i: int) -> dict[str, float]:
        sets = [x for w in watched for x in ("--set", w)]
        _torchrun(["-m", "trainer", "run", str(path), "--set", f"run.name=watched-{i}", *sets])
        return tps(f"watched-{i}")

    def bare_ddp(i: int) -> dict[str, float]:
        out = tmp_path / f"bare-{i}.json"
        _torchrun(
            [
                str(HERE / "bare_ddp.py"),
                str(assets["model"]),
                str(cache),
                str(BLOCK),
                str(MICRO),
                str(STEPS),
                str(out),
                str(vocab),
            ]
        )
        result = json.loads(out.read_text())
        return figures(result["tokens_per_s"], tuple(result["window"]))

    cluster = ray_cluster  # the session's: head + two 1-CPU nodes (tests/conftest.py)

    def raylift_ray(i: int) -> dict[str, float]:
        cfg = load_config(path, [f"run.name=ray-{i}"])
        client, job_id = submit.submit(cfg, cluster.dashboard_url, token=cluster.token)
        status, _ = follow(client, job_id, progress=False)
        assert status == "SUCCEEDED", client.get_job_logs(job_id)[-3000:]
        return tps(f"ray-{i}")

    commands = {
        "raylift_torchrun": raylift_torchrun,
        "bare_ddp": bare_ddp,
        "raylift_ray_train": raylift_ray,
        "raylift_torchrun_watched": raylift_torchrun_watched,
    }
    checks = [
        Check("ratio_torchrun", _ratio("raylift_torchrun"), SEAM_TARGET, unit="× bare"),
        Check("ratio_ray_train", _ratio("raylift_ray_train"), RAY_TARGET, unit="× bare"),
        Check(
            "ratio_watched",
            lambda r: (
                r["raylift_torchrun_watched"]["tokens_per_s"]
                / r["raylift_torchrun"]["tokens_per_s"]
            ),
            WATCH_TARGET,
            unit="× unwatched",
        ),
        Check(
            "ray_train_per_train_cpu",
            lambda r: _per_train_cpu(r["raylift_ray_train"]) / _per_train_cpu(r["bare_ddp"]),
            unit="× bare per training CPU-s",
        ),
        Check(
            "ray_other_cores",
            lambda r: r["raylift_ray_train"]["other_cores"] - r["bare_ddp"]["other_cores"],
            unit="cores, Ray run − bare",
        ),
    ]
    if smoke():
        # The watched run is the unwatched one plus trackers, which the integration tests
        # run end to end (test_torchrun, test_strategies); `make bench` measures it.
        del commands["raylift_torchrun_watched"]
        checks = [c for c in checks if c.name != "ratio_watched"]
    with cpu:
        result = run_benchmark(
            "overhead",
            title="Raylift loop vs bare torch DDP (2 gloo workers, CPU)",
            commands=commands,
            checks=checks,
            metric="tokens_per_s",
            unit="tokens/s",
            setup={
                "workers": 2,
                "backend": "gloo",
                "block_size": BLOCK,
                "micro_batch": MICRO,
                "steps": STEPS,
                "log_every": LOG_EVERY,
                "rows": ROWS,
                "model": f"Llama hidden {HIDDEN}, {LAYERS} layers, fp32, CPU",
            },
        )
    # The accounting found every run's training processes (two per run, each busy): found,
    # not how busy, which a loaded CI machine decides (0.16 cores once, 2 when quiet); a
    # run whose processes the watch missed reads 0.
    for name, figs in result["commands"].items():
        assert figs["train_cores"]["min"] > 0.05, (name, figs["train_cores"])
