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
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
HOLD_BUDDY_ENV = "RAYLIFT_FAULT_HOLD_BUDDY"
"""STEP:PATH, the same form: holds the RAM tier's copy of step STEP's snapshot to the
buddy keeper (trainer.checkpoint.memory), after the node's keeper has it; training goes
on meanwhile. The holder touches PATH.buddy.r<RANK>."""
UPLOAD_PAUSE_ENV = "RAYLIFT_FAULT_UPLOAD_PAUSE_S"
"""Seconds every checkpoint upload pauses between its data files and its manifests, the
window a kill or a storage outage must not turn into a checkpoint that looks complete.
SECONDS@RANK pauses only that rank's uploads (the rank as torchrun and Ray Train set RANK):
one rank's share lands well after the others', as a slow node's would."""
SLOW_STORAGE_ENV = "RAYLIFT_FAULT_SLOW_STORAGE"
"""PATH:SECONDS: while the file PATH exists, every checkpoint upload that starts pauses
SECONDS more between its data files and its manifests: a storage slowdown a test switches
on and off in the middle of a run (the cadence's write floor must lengthen the storage
interval)."""
MIN_STEP_ENV = "RAYLIFT_FAULT_MIN_STEP_S"
"""SECONDS:PATH: until the file PATH exists, every training step takes at least SECONDS
(the loop's per-step hold pads it, outside the step's phases). A test that must see
something happen before the run's last step (the cadence's write floor under slow storage)
keeps a fast machine's run that long, then lets it finish at full speed: its schedule is
then judged in steps and journal records, whatever the machine's speed. A step already
slower than SECONDS is not touched."""
KILL_AFTER_STEP_ENV = "RAYLIFT_FAULT_KILL_AFTER_STEP"
"""N: the first attempt's last rank SIGKILLs itself once every rank has finished step N.
N:settled: and once every rank's saves in flight (its RAM-tier snapshot's trip to the
keepers, its share of a storage upload) have landed, so whether a save made before the
kill survives it does not depend on how fast the machine was (the cadence test, whose
replay is told the kill waited: trainer.planner.faults_replay.Attempt.settled)."""
KILL_AFTER_SNAPSHOT_ENV = "RAYLIFT_FAULT_KILL_AFTER_SNAPSHOT"
"""N: the last rank SIGKILLs itself once its RAM-tier snapshot of step N is on its keepers,
before anything else of the step runs (the first time only, per run)."""
KILL_SCHEDULE_ENV = "RAYLIFT_FAULT_KILL_SCHEDULE"
"""EPOCH:T1,T2,...: a fault schedule in wall time (the cadence bench's, the same for every
config it compares). The last rank SIGKILLs itself at the end of its first logged step at
or after EPOCH + Ti (Unix seconds), once for each Ti (a marker file beside the machine's
temp files; the test cluster is one machine): a Ti that passes while no step runs (a
restart) fires at the next step. Steps are checked where the step report is due, so use
train.log_every: 1."""
WORKER_ENV = (
    UPLOAD_PAUSE_ENV,
    SLOW_STORAGE_ENV,
    MIN_STEP_ENV,
    KILL_AFTER_STEP_ENV,
    KILL_SCHEDULE_ENV,
    HOLD_ENV,
    HOLD_BUDDY_ENV,
    KILL_AFTER_SNAPSHOT_ENV,
    "RAYLIFT_SNAPSHOT_STAGING",  # not a fault: the RAM tier bench's disk staging (before)
)
"""The drills a Ray job's driver passes on to its workers."""
HOLD_LIMIT_S = 900.0
"""A held run goes on by itself after this long, so a test that dies never leaves a job
hanging on the cluster."""


def _hold_spec(env: str = HOLD_ENV) -> tuple[int, Path] | None:
    spec = os.environ.get(env, "")
    if not spec:
        return None
    step, _, path = spec.partition(":")
    return int(step), Path(path)


_last_step_end: float | None = None


def min_step(clock: Callable[[], float] = time.monotonic) -> float:
    """RAYLIFT_FAULT_MIN_STEP_S: pad this step to the drill's minimum (until its release
    file exists), counting from the previous call; returns the seconds slept."""
    global _last_step_end
    seconds, _, path = os.environ.get(MIN_STEP_ENV, "").partition(":")
    now = clock()
    last, _last_step_end = _last_step_end, now
    if not seconds or last is None or (path and Path(path).exists()):
        return 0.0
    pad = float(seconds) - (now - last)
    if pad <= 0:
        return 0.0
    time.sleep(pad)
    _last_step_end = clock()
    return pad


def hold(step: int, what: str, rank: int, env: str = HOLD_ENV) -> None:
    """Wait for the release file if the drill holds `step`; `what` is upload or train
    (after each training step, where RAYLIFT_FAULT_MIN_STEP_S pads the step too)."""
    if what == "train" and env == HOLD_ENV:
        min_step()
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


def upload_pause_s() -> float:
    """RAYLIFT_FAULT_UPLOAD_PAUSE_S (0 when unset, or set for another rank), plus
    RAYLIFT_FAULT_SLOW_STORAGE's seconds while its file exists."""
    seconds, _, rank = os.environ.get(UPLOAD_PAUSE_ENV, "").partition("@")
    mine = not rank or rank.strip() == os.environ.get("RANK", "0")
    pause = float(seconds or 0) if mine else 0.0
    path, _, seconds = os.environ.get(SLOW_STORAGE_ENV, "").rpartition(":")
    if path and Path(path).exists():
        pause += float(seconds)
    return pause


def kill_after_step(
    rank: int,
    world_size: int,
    done: int,
    first_attempt: Callable[[], bool],
    flush: Callable[[], None],
    barrier: Callable[[], None],
    settle: Callable[[], None] | None = None,
) -> None:
    """RAYLIFT_FAULT_KILL_AFTER_STEP=N: the first attempt's last rank SIGKILLs itself once
    every rank has finished step N (its checkpoint reported, when N is a checkpoint step),
    as a spot reclaim or an OOM kill would. Ray restarts the group from the newest complete
    checkpoint (with checkpoint.upload: sync, N's own when N is a checkpoint step); between
    checkpoints the steps since then are trained again, which lets a test compare them with
    the first attempt's. `flush` writes the metrics first, so that comparison has both;
    `first_attempt` and `barrier` are collective (rank 0 knows the attempt, every rank must
    agree). N must be a logged step (train.log_every). With N:settled, `settle` (waiting for
    this rank's saves in flight) runs on every rank before the kill."""
    kill_on_schedule(rank, world_size, done)
    at, _, how = os.environ.get(KILL_AFTER_STEP_ENV, "").partition(":")
    if not at or int(at) != done:
        return
    flush()
    if not first_attempt():
        return
    if how == "settled" and settle is not None:
        settle()  # every rank's writes in flight land, then the kill
        barrier()
    if rank == world_size - 1:
        log.warning("%s: killing rank %d after step %d", KILL_AFTER_STEP_ENV, rank, done)
        for handler in logging.getLogger().handlers + logging.getLogger("trainer").handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    barrier()  # the others wait here for the collective that fails


def kill_after_snapshot(done: int, rank: int, world_size: int, pending: Any, run_key: str) -> None:
    """RAYLIFT_FAULT_KILL_AFTER_SNAPSHOT=N: the last rank SIGKILLs itself right after its
    RAM-tier snapshot of step N reached its keepers (it waits for the send), as a kill
    between the snapshot and whatever the step does next would. Once per run: a marker
    file beside the machine's temp files (the test cluster is one machine)."""
    at = os.environ.get(KILL_AFTER_SNAPSHOT_ENV, "")
    if not at or int(at) != done or rank != world_size - 1:
        return
    marker = Path(tempfile.gettempdir()) / f"raylift-kill-after-snapshot-{run_key}-{done}"
    if marker.exists():
        return
    if pending is not None:
        pending.result()
    marker.touch()
    log.warning(
        "%s: killing rank %d after the snapshot of step %d", KILL_AFTER_SNAPSHOT_ENV, rank, done
    )
    for handler in logging.getLogger().handlers + logging.getLogger("trainer").handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def parse_schedule(spec: str) -> tuple[float, list[float]]:
    """RAYLIFT_FAULT_KILL_SCHEDULE's EPOCH:T1,T2,... as (epoch, [T1, T2, ...])."""
    epoch, _, times = spec.partition(":")
    return float(epoch), [float(x) for x in times.split(",") if x.strip()]


def schedule_marker(epoch: float, index: int) -> Path:
    return Path(tempfile.gettempdir()) / f"raylift-kill-schedule-{epoch:.3f}-{index}"


def due_kill(spec: str, now: float) -> int | None:
    """The first scheduled kill that is due at `now` and has not fired, else None."""
    epoch, times = parse_schedule(spec)
    for i, t in enumerate(times):
        if now >= epoch + t and not schedule_marker(epoch, i).exists():
            return i
    return None


def kill_on_schedule(rank: int, world_size: int, done: int) -> None:
    """RAYLIFT_FAULT_KILL_SCHEDULE: the last rank SIGKILLs itself when a scheduled kill is
    due (KILL_SCHEDULE_ENV). The other ranks learn of it in the next collective, as of a
    worker the kernel's OOM killer took."""
    spec = os.environ.get(KILL_SCHEDULE_ENV, "")
    if not spec or rank != world_size - 1:
        return
    i = due_kill(spec, time.time())
    if i is None:
        return
    epoch, times = parse_schedule(spec)
    schedule_marker(epoch, i).touch()
    log.warning(
        "%s: killing rank %d after step %d (scheduled kill %d at %.1f s)",
        KILL_SCHEDULE_ENV, rank, done, i, times[i],
    )  # fmt: skip
    for handler in logging.getLogger().handlers + logging.getLogger("trainer").handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
