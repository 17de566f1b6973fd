"""The wait for a job's worker group, as the job's driver reports it (WAIT_MARK lines from
trainer.autoscaling.watch): the nodes needed per worker shape against the nodes up, and which
pool the autoscaler is launching, and why (a failed spot launch, then on demand)."""

from __future__ import annotations

import json
from typing import Any

from tools.jobcli.runs import duration
from trainer.autoscaling.watch import WAIT_MARK


def parse(line: str) -> dict[str, Any] | None:
    at = line.find(WAIT_MARK)
    if at < 0:
        return None
    try:
        return json.loads(line[at + len(WAIT_MARK) :])
    except ValueError:
        return None


def last(logs: str) -> dict[str, Any] | None:
    """The newest wait record in a job's log."""
    found = None
    for line in logs.splitlines():
        rec = parse(line)
        if rec is not None:
            found = rec
    return found


def reason(rec: dict[str, Any]) -> str | None:
    """Which pool the job waits on and why, when the autoscaler says."""
    pending = [p["pool"] for p in rec.get("pending") or []]
    failed = rec.get("failed") or []
    if not pending and not failed:
        return None
    if not pending:
        f = failed[-1]
        return f"no launch pending; {f['pool']} failed: {f['why']}"
    why = ""
    gave_up = [f for f in failed if f["pool"] not in pending]
    if gave_up:
        why = "; " + ", ".join(f"{f['pool']} could not launch ({f['why']})" for f in gave_up)
    return f"waiting on pool {', '.join(pending)}{why}"


def lines(rec: dict[str, Any]) -> list[str]:
    """The wait in plain lines (what `--no-progress` and `status` print)."""
    if rec.get("started"):
        return [f"worker group started after {duration(rec.get('waited_s'))} waiting for nodes"]
    shapes = rec.get("shapes") or []
    up = sum(s["up"] for s in shapes)
    need = sum(s["need"] for s in shapes)
    out = [
        f"waiting {duration(rec.get('waited_s'))} for the worker group: {up}/{need} workers' "
        "nodes up"
    ]
    out += [f"  {s['up']}/{s['need']} up: {s['shape']}" for s in shapes]
    return out + [f"  {x}" for x in autoscaler_lines(rec)]


def autoscaler_lines(rec: dict[str, Any]) -> list[str]:
    """What the autoscaler is launching for the job, and why that pool."""
    out = []
    for p in rec.get("pending") or []:
        status = p.get("status") or (
            f"asked {duration(p['since_s'])} ago" if p.get("since_s") is not None else "booting"
        )
        out.append(f"launching {p['count']} × {p['pool']} ({status})")
    why = reason(rec)
    return out + ([why] if why else [])


class WaitBars:
    """The wait drawn on a rich Progress: one bar per worker shape (nodes up of needed), and
    the autoscaler's reason printed above it when it changes."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.tasks: dict[str, Any] = {}
        self._said: list[str] | None = None

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("started"):
            for task in self.tasks.values():
                self.bar.remove_task(task)
            self.tasks.clear()
            self.bar.console.print(lines(rec)[0], markup=False, highlight=False)
            return
        for s in rec.get("shapes") or []:
            label = f"nodes for {s['shape']}"
            if label not in self.tasks:
                self.tasks[label] = self.bar.add_task(label, total=s["need"], loss="")
            self.bar.update(self.tasks[label], completed=s["up"], total=s["need"])
        said = autoscaler_lines(
            {**rec, "pending": [{**p, "since_s": None} for p in rec.get("pending") or []]}
        )
        if said and said != self._said:
            self._said = said
            for line in said:
                self.bar.console.print(line, markup=False, highlight=False)
