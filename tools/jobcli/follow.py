"""Following a job: its log streamed as it is written, a step progress bar, the run's
summary picked out of the log, and why a job that did not succeed failed."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from typing import Any

from trainer.observability.logs import SUMMARY_MARK, find_marked, print_marked

_STEP = re.compile(r"step (\d+)/(\d+) loss ([0-9.]+)")


async def _follow(
    client: Any, job_id: str, progress: bool, echo: bool = True
) -> dict[str, Any] | None:
    """Stream the job's log; show a step progress bar parsed from rank 0's step lines."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from tools.jobcli import waiting

    console = Console(stderr=True)
    summary = None
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=False,
    )
    task = None
    bars = waiting.WaitBars(bar)

    def take(line: str) -> None:
        nonlocal summary, task
        found, line = find_marked(line, SUMMARY_MARK)
        if found is not None:
            summary = found
            if not line.strip():
                return
        if not echo:
            return
        wait = waiting.parse(line)
        if wait is not None:  # the driver's report of the worker group's wait for nodes
            if progress:
                bars.update(wait)
            else:
                for text in waiting.lines(wait):
                    print(text, flush=True)
            return
        if progress:
            bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)
        m = _STEP.search(line)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            if task is None:
                task = bar.add_task("training", total=total, loss=f"loss {m.group(3)}")
            bar.update(task, completed=done, total=total, loss=f"loss {m.group(3)}")

    with bar:
        # Ray's tail sends what the log file holds so far, so a chunk can end inside a
        # line (the driver still writing it): that part waits for the rest of its line.
        partial = ""
        async for chunk in client.tail_job_logs(job_id):
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                for piece in line.splitlines() or [""]:
                    take(piece)
        for piece in partial.splitlines():
            take(piece)
    return summary


def follow(
    client: Any, job_id: str, progress: bool = True, echo: bool = True
) -> tuple[str, dict[str, Any] | None]:
    summary = asyncio.run(_follow(client, job_id, progress and echo, echo))
    status = client.get_job_status(job_id)
    # The log stream can end a moment before the status flips; wait for a terminal one.
    deadline = time.monotonic() + 60
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return str(status.value if hasattr(status, "value") else status), summary


def follow_to_end(client: Any, job_id: str, progress: bool) -> int:
    status, summary = follow(client, job_id, progress=progress)
    if summary:
        print_marked(SUMMARY_MARK, summary)
    from tools.jobcli.cost import submission_cost_lines

    try:
        meta = client.get_job_info(job_id).metadata or {}
    except RuntimeError:
        meta = {}
    for line in submission_cost_lines(meta):
        print(line)
    print(f"job {job_id}: {status}", flush=True)
    if status == "SUCCEEDED":
        return 0
    for line in failure_lines(client, job_id, status):
        print(line, file=sys.stderr)
    return 1


def failure_lines(client: Any, job_id: str, status: str, tail: int = 20) -> list[str]:
    """Why a job did not succeed: Ray's own message, and the end of the job's log (the
    trainer's one-line `error: …` is the last thing a failed job prints)."""
    lines = [f"error: job {job_id} {status}"]
    try:
        message = client.get_job_info(job_id).message
    except RuntimeError:
        message = None
    if message:
        lines.append(f"  ray: {message.strip().splitlines()[-1]}")
    try:
        logs = client.get_job_logs(job_id).rstrip().splitlines()
    except RuntimeError:
        logs = []
    if logs:
        lines.append(f"  last {min(tail, len(logs))} lines of the job's log:")
        lines += [f"  | {x}" for x in logs[-tail:]]
    return lines
