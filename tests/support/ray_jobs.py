"""Submitting a job to the local Ray cluster the way `raylift run` does, and reading its
history back: shared by the integration tests and the benchmarks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tools.jobcli import submit
from tools.jobcli.follow import follow
from trainer.config import load_config
from trainer.observability.metrics import lineage, read_records
from trainer.preflight import run_all
from trainer.resilience import journal
from trainer.storage.location import resolve


def wait_for(pred, what: str, client: Any, job_id: str, timeout: float = 600.0) -> Any:
    """`pred`'s first truthy value, polled; fails at once if the job ends first, with its
    log. The timeout only fires when something is broken (a loaded 2-core machine is
    slow)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        status = client.get_job_status(job_id)
        assert not status.is_terminal(), (
            f"job ended ({status}) waiting for {what}:\n{client.get_job_logs(job_id)[-4000:]}"
        )
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{client.get_job_logs(job_id)[-4000:]}")


def run_driver(cluster: Any, code: str, *args: object, timeout: float = 300.0) -> str:
    """Runs `code` as a Ray driver of its own, `python -c code <cluster address> args`,
    with the cluster's token, and returns its stdout. Never `ray.init` inside pytest: the
    process caches the first auth token it reads (another cluster's, or the
    ~/.ray/auth_token Ray writes for a local `ray.init`), and Ray reads its loopback
    setting when first imported; a driver inside pytest has waited so on a GCS that never
    let it in (3 RAM-tier tests timed out in CI)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": cluster.token}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run(
        [sys.executable, "-c", code, cluster.address, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert res.returncode == 0, f"driver failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return res.stdout


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


def run_killed(cluster, job_path: Path, at: int, overrides: list[str] | None = None, env=None):
    """One Ray job whose last rank the fault drill SIGKILLs after step `at` (first attempt
    only); Ray Train restarts the group from the newest complete checkpoint."""
    env = {**(env or {}), "RAYLIFT_FAULT_KILL_AFTER_STEP": str(at)}
    return run_to_end(cluster, job_path, overrides, env=env)


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


def recovery_after_self_kill(
    cluster: Any, job_path: Path, at_step: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs a job whose last rank SIGKILLs itself once every rank has finished step
    `at_step` (the fault drill, first attempt only) to success. Rank 0 flushes the metrics
    just before, so the step's record marks the kill, on local storage and on S3 alike
    (S3 metrics are otherwise rewritten only at checkpoints and every 15 s). Returns the
    seconds from the kill to the restarted attempt's first step (`seconds`) and to its
    first new step, the first past `at_step` (`new_step_seconds`: the run making progress
    again, retrained steps included), and the journal's `lost_steps` and `restored_from`."""
    cfg, _, _ = run_killed(cluster, job_path, at_step, env=env)
    run = resolve(cfg.storage.path, cfg.storage.endpoint_override).join(cfg.run.name)
    steps = [r for r in read_records(run.join("metrics.jsonl")) if "loss" in r]
    killed = max(r["time"] for r in steps if r.get("attempt") == 1 and r["step"] == at_step)
    second = [r for r in steps if r.get("attempt") == 2]
    attempts = [a for a in journal.read(run) if a["event"] == "attempt"]
    return {
        "seconds": min(r["time"] for r in second) - killed,
        "new_step_seconds": min(r["time"] for r in second if r["step"] > at_step) - killed,
        "lost_steps": float(attempts[-1]["lost_steps"]),
        "restored_from": attempts[-1].get("restored_from"),
    }
