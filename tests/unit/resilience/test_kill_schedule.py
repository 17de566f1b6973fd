"""The wall-time fault schedule (RAYLIFT_FAULT_KILL_SCHEDULE, trainer.faults): the
cadence bench's kills, the same for every config it compares. Each scheduled kill fires
once, on the last rank only, at the first logged step at or after its time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support.jobs import ROOT
from trainer import faults

CALL = (
    "import sys; from trainer import faults; "
    "faults.kill_after_step(int(sys.argv[1]), 2, 7, None, lambda: None, lambda: None); "
    "print('alive')"
)


def _step(rank: int, spec: str) -> subprocess.CompletedProcess:
    """One rank's end of step 7 in a process of its own (the kill is a real SIGKILL)."""
    env = {**os.environ, faults.KILL_SCHEDULE_ENV: spec, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", CALL, str(rank)], env=env, capture_output=True, text=True
    )


def test_each_scheduled_kill_fires_once_on_the_last_rank() -> None:
    epoch = time.time() - 10.0  # kills due at -9 s and -5 s from now; one in an hour
    spec = f"{epoch}:1,5.5,3600"
    try:
        assert faults.due_kill(spec, time.time()) == 0
        assert _step(0, spec).stdout.strip() == "alive"  # rank 0 of 2: never
        assert not faults.schedule_marker(epoch, 0).exists()
        first = _step(1, spec)
        assert first.returncode == -signal.SIGKILL, first.stderr
        assert faults.schedule_marker(epoch, 0).exists()
        assert faults.due_kill(spec, time.time()) == 1  # the next one, passed meanwhile
        assert _step(1, spec).returncode == -signal.SIGKILL
        assert _step(1, spec).stdout.strip() == "alive"  # both fired; the third not due
        assert faults.due_kill(spec, epoch + 3600) == 2
    finally:
        for i in range(3):
            faults.schedule_marker(epoch, i).unlink(missing_ok=True)


def test_the_schedule_parses_and_the_drill_reaches_the_workers() -> None:
    assert faults.parse_schedule("1700000000.5:3,10.25") == (1700000000.5, [3.0, 10.25])
    assert faults.KILL_SCHEDULE_ENV in faults.WORKER_ENV
