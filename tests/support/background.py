"""Reference runs started in the background: the fault and RAM-tier tests compare each
faulted run against an uninterrupted torchrun of the same job, which they need only at
their end. Started at once, a reference trains while a Ray job is still starting up (mostly
single-threaded imports and polls, ~45 s on the CI machine), instead of adding its own
~20 s of torchrun start-up and training to the file's time before the first job is even
submitted."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from tests.support.torchrun import torchrun_command

log = logging.getLogger(__name__)

NICE = 10


class BackgroundRun:
    """`python -m trainer run JOB` under torchrun on loopback, started now; `wait()` blocks
    until it has finished and fails the calling test with its stderr if it failed. Its own
    process group, so `stop()` ends torchrun and its ranks together (and only them)."""

    def __init__(self, job: Path, nproc: int = 2, timeout: float = 1800) -> None:
        cmd, env = torchrun_command(["-m", "trainer", "run", str(job)], nproc)
        # Below the Ray jobs it overlaps: it fills their idle time rather than slowing them.
        cmd = ["nice", "-n", str(NICE), *cmd]
        self.job, self.timeout = job, timeout
        self._log = job.with_suffix(".stderr")
        with open(self._log, "wb") as err:  # the child keeps its own copy
            self._proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        rc = self._proc.wait(timeout=self.timeout)
        err = self._log.read_text(errors="replace")
        assert rc == 0, f"reference run {self.job} failed ({rc}):\n{err[-3000:]}"
        self._done = True

    def stop(self) -> None:
        """Ends a run still going (a test that failed before waiting on it)."""
        if self._proc.poll() is None:
            log.warning("stopping the unfinished reference run %s", self.job)
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
