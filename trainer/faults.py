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

Inside an online RL step (a kill mid-rollout or mid-update, digests to compare attempts)
the drills reach the rollout and the objective through trainer.rollouts.drills' hooks,
which `arm_rl_drills` replaces at the attempt's start (RLDrills).
"""

from __future__ import annotations

import hashlib
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
(trainer.storage.staging) after its data files and before its manifest, until PATH exists;
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
KILL_IN_ROLLOUT_ENV = "RAYLIFT_FAULT_KILL_IN_ROLLOUT"
"""N: online RL (trainer.rollouts): the last rank SIGKILLs itself inside step N's rollout,
its completions sampled and not yet scored (the other ranks wait in the rewards' gather).
Once per run: the first attempt that reaches step N's rollout fires it (a marker file
beside the machine's temp files, keyed by the run; the test cluster is one machine), so
the attempt that resumes samples step N again. A step reusing a rollout (num_iterations
> 1) samples nothing: N names a step that samples."""
KILL_IN_UPDATE_ENV = "RAYLIFT_FAULT_KILL_IN_UPDATE"
"""N: online RL: the last rank SIGKILLs itself inside step N's update, before its last
micro batch: every earlier micro batch's backward has accumulated its gradients and the
optimizer step has not run (with one micro batch a worker, before its forward). Once per
run, as KILL_IN_ROLLOUT: with both set and the update's step the later, the first attempt
dies in the rollout and the attempt that resumes dies in the update."""
WEIGHT_DIGEST_ENV = "RAYLIFT_FAULT_WEIGHT_DIGEST"
"""1: every reported online RL step writes `debug/weights_sha256`, the SHA-256 of the
trainable parameters after the step (in name order, each gathered whole under FSDP2 and
ZeRO-3, so the digest does not depend on the layout), and, when the step sampled,
`debug/completions_sha256`, of every rank's completion ids in rank order. A test compares
the steps an attempt trains again with the same steps of an earlier attempt, bit for bit,
without a second job. The metrics file on S3 is rewritten on flush: what a SIGKILL cuts
short there is lost, so a comparison wants local or shared storage."""
WORKER_ENV = (
    UPLOAD_PAUSE_ENV,
    SLOW_STORAGE_ENV,
    MIN_STEP_ENV,
    KILL_AFTER_STEP_ENV,
    KILL_SCHEDULE_ENV,
    HOLD_ENV,
    HOLD_BUDDY_ENV,
    KILL_AFTER_SNAPSHOT_ENV,
    KILL_IN_ROLLOUT_ENV,
    KILL_IN_UPDATE_ENV,
    WEIGHT_DIGEST_ENV,
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


def in_step_kill(env: str) -> int | None:
    """The step a RAYLIFT_FAULT_KILL_IN_* drill names, or None when it is unset. A value
    that is not a whole step number of at least 1 is one clear line."""
    spec = os.environ.get(env, "").strip()
    if not spec:
        return None
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"{env}={spec!r}: expected a step number N >= 1 (the step to kill in)")
    return int(spec)


def _sigkill_self(message: str, *args: Any) -> None:
    log.warning(message, *args)
    for handler in logging.getLogger().handlers + logging.getLogger("trainer").handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class RLDrills:
    """The drills inside an online RL step (trainer.rollouts.drills.Drills' hooks): the
    kills of KILL_IN_ROLLOUT_ENV and KILL_IN_UPDATE_ENV, the digests of WEIGHT_DIGEST_ENV.
    Built from the environment once per attempt; `run_key` names the run in the markers."""

    def __init__(self, run_key: str, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.key = hashlib.sha1(run_key.encode()).hexdigest()[:12]
        self.rollout_at = in_step_kill(KILL_IN_ROLLOUT_ENV)
        self.update_at = in_step_kill(KILL_IN_UPDATE_ENV)
        self.digest = os.environ.get(WEIGHT_DIGEST_ENV, "") not in ("", "0")

    @property
    def armed(self) -> bool:
        return self.rollout_at is not None or self.update_at is not None or self.digest

    def marker(self, what: str, step: int) -> Path:
        return Path(tempfile.gettempdir()) / f"raylift-kill-in-{what}-{self.key}-{step}"

    def _once(self, what: str, step: int) -> bool:
        """Whether the kill of `what` at `step` fires here: the last rank, the first time."""
        if self.rank != self.world_size - 1:
            return False
        marker = self.marker(what, step)
        if marker.exists():
            return False
        marker.touch()
        return True

    def in_rollout(self, step: int) -> None:
        if step == self.rollout_at and self._once("rollout", step):
            _sigkill_self(
                "%s: killing rank %d in step %d's rollout (sampled, not scored)",
                KILL_IN_ROLLOUT_ENV, self.rank, step,
            )  # fmt: skip

    def in_update(self, step: int, micro: int, micros: int) -> None:
        if step == self.update_at and micro == micros - 1 and self._once("update", step):
            _sigkill_self(
                "%s: killing rank %d in step %d's update (before micro batch %d of %d, "
                "before the optimizer step)",
                KILL_IN_UPDATE_ENV, self.rank, step, micro + 1, micros,
            )  # fmt: skip

    def digests(self, model: Any, completions: list[str]) -> dict[str, str]:
        """Collective (every rank): the weights' digest and, for a step that sampled, the
        completions' (each rank's in rank order)."""
        if not self.digest:
            return {}
        out = {"debug/weights_sha256": weights_digest(model)}
        everyone = _gather_objects(completions)
        if any(everyone):
            joined = "|".join(",".join(c) for c in everyone)
            out["debug/completions_sha256"] = hashlib.sha256(joined.encode()).hexdigest()
        return out


def _gather_objects(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _whole(p: Any) -> Any:
    """A parameter's whole tensor on the CPU: FSDP2's DTensor gathered, ZeRO-3's
    partition gathered (collectives: every rank calls them in the same order)."""
    if hasattr(p, "ds_id"):  # ZeRO-3: partitioned outside its module's forward
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().cpu().clone()
    if hasattr(p, "full_tensor"):  # FSDP2's DTensor
        return p.full_tensor().detach().cpu()
    return p.detach().cpu()


def weights_digest(model: Any) -> str:
    """SHA-256 of the trainable parameters' names, shapes, dtypes and bytes, in name order,
    each whole whatever the layout. Collective under FSDP2 and ZeRO-3."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: _plain(kv[0])):
        if not p.requires_grad:
            continue
        t = _whole(p).contiguous()
        h.update(f"{_plain(name)}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _plain(name: str) -> str:
    """A parameter's name without its wrappers' prefix (DDP's and DeepSpeed's `module.`)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def arm_rl_drills(objective: Any, run_key: str, rank: int, world_size: int) -> None:
    """Give an online RL objective (one with `arm_drills`) the drills its environment
    asks for; any other objective, or an environment without them, keeps its no-ops."""
    arm = getattr(objective, "arm_drills", None)
    drills = RLDrills(run_key, rank, world_size)
    if arm is not None and drills.armed:
        arm(drills)
