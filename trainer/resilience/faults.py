"""Fault drills that a test (or a chaos drill on a real cluster) switches on through the
environment. They exist so that a fault can be made to land inside a window that is
otherwise a few milliseconds wide, without the test racing the run's clock.

RAYLIFT_FAULT_HOLD=STEP:PATH holds the checkpoint of step STEP twice: its upload stops
between the data files and the manifests (the window in which a kill or a storage outage
must not produce a checkpoint that looks complete), and training stops after the step,
until the file PATH exists. While it waits, each holder touches PATH.upload.r<RANK> or
PATH.train.r<RANK>, so the test waits on those files (every rank's) instead of polling
storage. On a real
cluster PATH must be on a folder every node sees (the shared file system).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

HOLD_ENV = "RAYLIFT_FAULT_HOLD"
HOLD_WRITE_ENV = "RAYLIFT_FAULT_HOLD_WRITE"
"""STEP:PATH, the same form: holds only the background write of step STEP's checkpoint
(trainer.checkpoint.staging) after its data files and before its manifest, until PATH exists;
training goes on meanwhile, which is the point. The holder touches PATH.write.r<RANK>."""
HOLD_UPLOAD_ENV = "RAYLIFT_FAULT_HOLD_UPLOAD"
"""STEP:PATH, the same form: holds only step STEP's upload, before its manifests, until
PATH exists; training goes on meanwhile (a background upload). The holder touches
PATH.upload.r<RANK>."""
HOLD_LIMIT_S = 900.0
"""A held run goes on by itself after this long, so a test that dies never leaves a job
hanging on the cluster."""


def _hold_spec(env: str = HOLD_ENV) -> tuple[int, Path] | None:
    spec = os.environ.get(env, "")
    if not spec:
        return None
    step, _, path = spec.partition(":")
    return int(step), Path(path)


def hold(step: int, what: str, rank: int, env: str = HOLD_ENV) -> None:
    """Wait for the release file if the drill holds `step`; `what` is upload or train."""
    spec = _hold_spec(env)
    if spec is None or spec[0] != step:
        return
    release = spec[1]
    if release.exists():
        return
    log.warning(
        "%s: rank %d holds the %s of step %d until %s exists", env, rank, what, step, release
    )
    release.with_name(f"{release.name}.{what}.r{rank}").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    log.warning("%s: rank %d released the %s of step %d", env, rank, what, step)


def hold_write(step: int, rank: int) -> None:
    """RAYLIFT_FAULT_HOLD_WRITE: hold the background write of `step`'s checkpoint."""
    hold(step, "write", rank, HOLD_WRITE_ENV)
