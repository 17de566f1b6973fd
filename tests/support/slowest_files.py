"""The ten slowest test FILES of a run (setup, call and teardown summed per file), printed
at the end of every `make test`: CI's time is spent file by file (two xdist workers, a
file each at a time, `--dist loadfile`), so a file's sum is what its worker was busy with,
and what a cut must bring down. Registered by tests/conftest.py's hooks."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

TOP = 10


class FileTimes:
    """Seconds per test file, from the reports the controller receives (under xdist the
    workers' reports reach the controller's hooks too)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)

    def add(self, report: Any) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += float(getattr(report, "duration", 0.0) or 0.0)
        if report.when == "call":
            self.tests[path] += 1

    def write(self, path: Path) -> None:
        """The whole run's seconds per file as JSON (sorted, rounded): what
        tests/support/file_order.py orders the next runs by."""
        ranked = sorted(self.seconds.items(), key=lambda kv: kv[1], reverse=True)
        path.write_text(json.dumps({p: round(s, 1) for p, s in ranked}, indent=1) + "\n")

    def lines(self, top: int = TOP) -> list[str]:
        ranked = sorted(self.seconds.items(), key=lambda kv: kv[1], reverse=True)[:top]
        total = sum(self.seconds.values())
        out = [f"{s:9.1f} s  {self.tests[p]:4d} tests  {p}" for p, s in ranked]
        out.append(f"{total:9.1f} s  in all ({len(self.seconds)} files), worker-seconds")
        return out
