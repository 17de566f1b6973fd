"""A job that needs more nodes than are up: its driver reports the wait (nodes needed per
worker shape against the nodes up) until the worker group starts, `raylift status` and the
follower show it; and an elastic job starts on what is up and grows when a node joins.

Both run real `python -m trainer run` jobs on the session's local cluster (a head with no
CPUs, a large_cpu_mem node and a plain node, one CPU each) and add a third node mid-run, which
they remove again, leaving the cluster as they found it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobs import write_job
from tests.support.ray_jobs import history, wait_for
from tools.jobcli import submit, verbs, waiting
from tools.jobcli.follow import follow
from trainer.config import load_config
from trainer.observability.metrics import read_records
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _stopped_at_exit(client: Any, job_id: str):
    """A failed test leaves no job running on the session cluster for the next test."""
    try:
        yield
    finally:
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)


@contextlib.contextmanager
def _extra_node(cluster: Any):
    """A third 1-CPU worker node, removed again afterwards."""
    node = cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
    try:
        yield node
    finally:
        cluster.kill_node(node)


def test_a_job_waiting_for_nodes_shows_them_until_its_worker_group_starts(
    ray_cluster, tiny, tmp_path
):
    path = write_job(
        tiny,
        tmp_path,
        "waits",
        scaling={"num_workers": 3, "rank0_label": {"large_cpu_mem": "true"}},
        train={"max_steps": 6, "eval_every": None, "micro_batch_size": 2},
        checkpoint={"every_steps": 6},
    )
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    client, job_id = submit.submit(cfg, ray_cluster.dashboard_url)
    stack = contextlib.ExitStack()
    stack.enter_context(_stopped_at_exit(client, job_id))
    with stack:
        _check_the_wait(ray_cluster, cfg, client, job_id)


def _check_the_wait(ray_cluster: Any, cfg: Any, client: Any, job_id: str) -> None:
    def waiting_record():
        rec = waiting.last(client.get_job_logs(job_id))
        return rec if rec and not rec["started"] else None

    rec = wait_for(waiting_record, "the driver's wait report", client, job_id)
    # Rank 0 needs the labelled node (up); the two others need plain room, one node's up.
    shapes = {s["shape"]: (s["up"], s["need"]) for s in rec["shapes"]}
    assert shapes == {"CPU 1 on large_cpu_mem=true": (1, 1), "CPU 1": (1, 2)}, rec
    # `raylift status` says the same while it waits.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verbs.status(argparse.Namespace(run=cfg.run.name), client, None)
    assert "waiting: 1/2 up: CPU 1" in out.getvalue(), out.getvalue()

    with _extra_node(ray_cluster):
        status, _ = follow(client, job_id, progress=False, echo=False)
        assert status == "SUCCEEDED", client.get_job_logs(job_id)[-4000:]
    logs = client.get_job_logs(job_id)
    done = waiting.last(logs)
    assert done is not None and done["started"], logs[-3000:]
    assert {s["shape"]: s["up"] for s in done["shapes"]}["CPU 1"] == 2
    assert "worker group started after" in waiting.lines(done)[0]
    starts = [r for r in history(cfg)[0] if r.get("event") == "start"]
    assert starts and starts[-1]["world_size"] == 3
    # The run recorded its worker nodes; a local cluster's carry no instance type: no price.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verbs.status(argparse.Namespace(run=cfg.run.name), client, None)
    assert "nodes carry no instance type (a local cluster): nothing to price" in (out.getvalue()), (
        out.getvalue()
    )


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_an_elastic_job_starts_on_what_is_up_and_grows_when_a_node_joins(
    ray_cluster, tiny, tmp_path
):
    """num_workers [2, 3] with two worker nodes up: it starts on two at once; when a third
    node joins, Ray Train 2.60's elastic policy resizes the running worker group (it stops
    the group and starts a larger one, which resumes from the last checkpoint)."""
    path = write_job(
        tiny,
        tmp_path,
        "grows",
        # Global batch 12: the same on 2 and on 3 workers (micro 2 × grad_accum 3 or 2).
        scaling={"num_workers": [2, 3], "elastic_resize_interval_s": 2},
        train={"max_steps": 400, "eval_every": None, "micro_batch_size": 2, "grad_accum": 2},
        checkpoint={"every_steps": 10, "upload": "sync"},
    )
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    client, job_id = submit.submit(cfg, ray_cluster.dashboard_url)
    metrics = resolve(str(Path(cfg.storage.path) / cfg.run.name)).join("metrics.jsonl")
    with _stopped_at_exit(client, job_id):
        _check_growth(ray_cluster, client, job_id, metrics)


def _check_growth(ray_cluster: Any, client: Any, job_id: str, metrics: Any) -> None:

    def starts() -> list[dict[str, Any]]:
        return [r for r in read_records(metrics) if r.get("event") == "start"]

    def stepped_on(world: int):
        return lambda: (
            any(r.get("world_size") == world for r in starts())
            and any(
                "step" in r and r.get("event", "train") == "train" for r in read_records(metrics)
            )
        )

    wait_for(stepped_on(2), "steps on the two workers that are up", client, job_id)
    with _extra_node(ray_cluster):
        wait_for(lambda: any(r["world_size"] == 3 for r in starts()), "growth", client, job_id)
        client.stop_job(job_id)  # what it had to show is shown; the rest would only take time
        follow(client, job_id, progress=False, echo=False)
    sizes = [r["world_size"] for r in starts()]
    assert sizes[0] == 2 and 3 in sizes, sizes
