"""A rebalance recommendation reaches the running job: its checkpoint intervals shorten for a
while (trainer.planner.cadence's burst).

EC2 sends a rebalance recommendation when a spot instance's capacity pool is at an elevated
risk of interruption, sometimes well before the two-minute notice. Only the node agent
(trainer.resilience.agent, one per node, in the container beside `ray start`) sees it, in
the instance metadata; it writes the notice to a file on the node (`notice_path()`), and
every training rank on that node reads the file in its step's flags. The ranks add their
flags up in the step's existing all-reduce, so every rank of the job agrees on the same
step: there the cadence's rates count BURST_FACTOR times higher for BURST_S (the intervals
halve) and rank 0 journals a `rebalance` record. Unless `--drain-on-rebalance`, nothing
else happens: the node may well stay.

A notice counts once per attempt and only while it is fresh (younger than BURST_S); a new
attempt that finds it still fresh shortens again, since the risk it announced still stands.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer.planner.cadence import BURST_S

log = logging.getLogger("trainer")

FILE_ENV = "RAYLIFT_REBALANCE_FILE"
"""Where the agent writes a rebalance notice and the ranks look for it (default: the
node's temp folder, which the agent and the Ray workers in one container share)."""
WHY = "rebalance recommendation"


def notice_path() -> Path:
    return Path(os.environ.get(FILE_ENV) or Path(tempfile.gettempdir()) / "raylift-rebalance.json")


def write_notice(body: str, path: Path | None = None) -> None:
    """The agent's side: the metadata service's notice body, as it came, written whole (a
    rank never reads half of it)."""
    path = path or notice_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(body)
    tmp.replace(path)


def read_notice(path: Path | None = None) -> float | None:
    """The notice's time (Unix seconds) from the file, None without one. A body that does
    not parse counts from when the file was written."""
    path = path or notice_path()
    try:
        body = path.read_text()
        written = path.stat().st_mtime
    except OSError:
        return None
    try:
        stamp = str(json.loads(body)["noticeTime"]).replace("Z", "+00:00")
        return datetime.fromisoformat(stamp).timestamp()
    except (ValueError, KeyError, TypeError):
        return written


class RebalanceWatch:
    """The loop's side, one per rank: `ask()` is this rank's flag for the step's all-reduce
    (1.0 the first time it sees a fresh notice), `agreed(summed, done)` acts on the sum the
    same way on every rank: the cadence shortens, rank 0 journals."""

    def __init__(
        self,
        rt: Any,
        cadence: Any,
        enabled: bool = True,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.rt, self.cadence, self.enabled = rt, cadence, enabled
        self.path = path or notice_path()
        self.clock = clock
        self.seen: float | None = None  # the notice time this rank flagged last
        self._mtime: float | None = None

    def ask(self) -> float:
        if not self.enabled:
            return 0.0
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return 0.0
        if mtime == self._mtime:  # read only when the agent wrote the file again
            return 0.0
        self._mtime = mtime
        when = read_notice(self.path)
        if when is None or when == self.seen or self.clock() - when >= BURST_S:
            return 0.0
        self.seen = when
        return 1.0

    def agreed(self, summed: float, done: int) -> None:
        if summed <= 0:
            return
        if self.cadence is not None:
            self.cadence.shorten(WHY)
        rt = self.rt
        if rt.rank == 0:
            action = "intervals shortened" if self.cadence is not None else "fixed intervals kept"
            log.warning(
                "step %d: EC2 rebalance recommendation on a node of the run: %s", done, action
            )
            if getattr(rt, "journal", None) is not None:
                rt.journal.add(
                    "rebalance",
                    step=done,
                    ranks=int(summed),
                    shortened=self.cadence is not None,
                    burst_s=BURST_S if self.cadence is not None else 0.0,
                )
