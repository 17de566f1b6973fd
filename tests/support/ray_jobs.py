"""Submitting a job to the local Ray cluster the way `raylift run` does, and reading its
history back: shared by the integration tests and the benchmarks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psutil

from tools.jobcli import submit
from tools.jobcli.follow import follow
from trainer.config import load_config
from trainer.observability.metrics import lineage, read_records
from trainer.preflight import run_all
from trainer.storage.location import resolve


def launch(cluster, job_path: Path, overrides: list[str] | None = None, env=None):
    cfg = submit.absolutize(load_config(job_path, overrides or []), Path.cwd())
    run_all(cfg, strict=True)
    client, job_id = submit.submit(cfg, cluster.dashboard_url, env_vars=env)
    return cfg, client, job_id


def run_to_end(cluster, job_path: Path, overrides: list[str] | None = None, env=None):
    cfg, client, job_id = launch(cluster, job_path, overrides, env)
    status, summary = follow(client, job_id, progress=False)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-4000:]
    return cfg, summary, logs


def run_killed(cluster, job_path: Path, at: int, overrides: list[str] | None = None):
    """One Ray job whose last rank the fault drill SIGKILLs after step `at` (first attempt
    only); Ray Train restarts the group from the newest complete checkpoint."""
    return run_to_end(cluster, job_path, overrides, env={"RAYLIFT_FAULT_KILL_AFTER_STEP": str(at)})


def retrained(records: list[dict[str, Any]], steps: list[int]) -> list[tuple[float, float]]:
    """(first attempt's loss, second attempt's loss) of each step both trained."""
    by = {(r.get("attempt"), r["step"]): r["loss"] for r in records if "loss" in r}
    return [(by[(1, s)], by[(2, s)]) for s in steps]


def history(cfg) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    run = resolve(cfg.storage.path, cfg.storage.endpoint_override).join(cfg.run.name)
    records = read_records(run.join("metrics.jsonl"))
    steps, wasted = lineage(records)
    return records, steps, wasted


def train_workers(client: Any, job_id: str) -> dict[int, psutil.Process]:
    """The current worker group of a running job, by rank: the controller logs each group
    it starts with every rank's pid. (Ray may hand a new actor an idle worker process it
    started earlier, so a process's age says nothing about which group it belongs to.)"""
    found = re.findall(r"pid=(\d+)\) world_rank=(\d+),", client.get_job_logs(job_id))
    pids: dict[int, int] = {}
    for pid, rank in found:
        if rank == "0":
            pids = {}  # a newer group starts
        pids[int(rank)] = int(pid)
    group = {rank: psutil.Process(pid) for rank, pid in pids.items()}
    assert group and all("RayTrainWorker" in p.name() for p in group.values()), group
    return group
