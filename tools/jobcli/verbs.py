"""`status`, `logs`, `stop` and `list`: the runs already on the cluster, found by run name
(or a submission id), shown or stopped."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from tools.jobcli import cluster, runs, waiting
from tools.jobcli.cost import submission_cost_lines
from tools.jobcli.follow import follow_to_end
from tools.jobcli.goodputlines import submission_goodput_lines
from trainer.errors import UserError


def _pick(client: Any, name: str, live_only: bool = False) -> Any:
    """A run's newest (or newest live) submission; a submission id works too."""
    jobs = client.list_jobs()
    exact = [j for j in jobs if j.submission_id == name]
    mine = exact or runs.submissions(jobs, name)
    if not mine:
        known = ", ".join(runs.by_run(jobs)) or "none"
        raise UserError(f"no run or submission named {name!r} on this cluster (runs: {known})")
    if live_only:
        job = runs.live(mine)
        if job is None:
            newest = mine[-1]
            raise UserError(
                f"{name}: nothing to stop; its newest submission {newest.submission_id} is "
                f"{runs.state(newest)}"
            )
        return job
    return mine[-1]


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _runs_table(client: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="runs")
    for col in ("run", "submission", "state", "started", "ended"):
        table.add_column(col)
    for name, jobs in runs.by_run(client.list_jobs()).items():
        for i, job in enumerate(reversed(jobs)):
            table.add_row(
                name if i == 0 else "",
                job.submission_id,
                runs.state(job),
                _when(job.start_time),
                _when(job.end_time),
            )
    Console(width=140).print(table)
    return 0


def submission_export_lines(meta: dict[str, str]) -> list[str]:
    """The run's newest export and the checks made on it (trainer.checkpoint.export_check);
    nothing when its storage is not readable from here (the cost line already says why)."""
    from trainer.checkpoint.export_check import export_lines

    try:
        run = runs.submission_run(meta)
        return export_lines(run) if run is not None else []
    except Exception:  # a shared-FS path only the cluster mounts, no credentials, …
        return []


def status(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    if not args.run:
        return _runs_table(client)
    job = _pick(client, args.run)
    meta = job.metadata or {}
    total = None
    if not meta.get("raylift_max_steps"):
        with contextlib.suppress(RuntimeError):
            total = runs.total_from_logs(client.get_job_logs(job.submission_id))
    p = runs.read_progress(meta, total)
    state = runs.state(job)
    step = "-" if p.step is None else f"{p.step}" + (f"/{p.total}" if p.total else "")
    lines = [
        ("run", meta.get(runs.RUN_KEY, args.run)),
        ("submission", job.submission_id),
        ("state", state),
        ("step", step),
        ("loss", "-" if p.loss is None else f"{p.loss:.4f}"),
        ("tokens/s", "-" if p.tokens_per_s is None else f"{p.tokens_per_s:.0f}"),
        ("eta", runs.duration(p.eta_s) if state in runs.LIVE else "-"),
        ("restarts", str(p.restarts)),
        ("lost steps", str(p.lost_steps)),
        ("memory", p.memory or "-"),
        ("slowest", p.slowest or "-"),
    ]
    if p.rewards:
        lines.append(("rewards", p.rewards))
    if p.benchmarks:
        lines.append(("benchmarks", p.benchmarks))
    if p.note:
        lines.append(("note", p.note))
    if state in runs.LIVE:
        with contextlib.suppress(RuntimeError):
            wait = waiting.last(client.get_job_logs(job.submission_id))
            if wait is not None and not wait.get("started"):
                lines += [("waiting", text.strip()) for text in waiting.lines(wait)]
    else:
        # "cost: ..." and the planned-against-measured "memory: ..." lines, each by its label
        lines += [text.partition(": ")[::2] for text in submission_cost_lines(meta)]
        lines += [("goodput", t.split(": ", 1)[1]) for t in submission_goodput_lines(meta)]
        lines += [text.partition(": ")[::2] for text in submission_export_lines(meta)]
    if job.message and state not in runs.LIVE:
        lines.append(("ray", job.message.strip().splitlines()[-1]))
    for key, value in lines:
        print(f"{key:>11}: {value}")
    return 1 if state in ("FAILED", "STOPPED") else 0


def logs(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    job = _pick(client, args.run)
    if args.follow:
        return follow_to_end(client, job.submission_id, progress=False)
    sys.stdout.write(client.get_job_logs(job.submission_id))
    sys.stdout.flush()
    return 0


def stop(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    job = _pick(client, args.run, live_only=True)
    client.stop_job(job.submission_id)
    deadline = time.monotonic() + 60
    status = client.get_job_status(job.submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job.submission_id)
    print(f"job {job.submission_id}: {getattr(status, 'value', status)}", flush=True)
    return 0


def list_runs(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    return _runs_table(client)
