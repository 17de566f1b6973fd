"""Checkpoint staging: copy the state off the training path, write it in the background.

A checkpoint step used to stop training for the local `torch.save` (or `dcp.save`) of
the whole resume state before the upload was handed off. Now a part that can `stage`
copies its state into host memory on the training thread (a memcpy: tens of ms per
100 MB) and returns a writer; the manager runs the writers, then the rank's manifest, on
one background thread per process. Whoever uploads the folder (`Runtime._upload`) waits
for that write first, so a checkpoint is still "complete" only when every file is written
and uploaded, manifests last: a kill during the background write leaves a local folder
that was never uploaded, and storage keeps the previous checkpoint.

The price is host RAM: one staging copy of this rank's resume state per checkpoint in
flight (the planner counts one: `trainer.planner.memory.host_memory`, `staging`).

The background threads run under Linux's SCHED_IDLE policy (`checkpoint.background_idle`;
or at a lower nice value, `checkpoint.background_nice`): where training keeps every core
busy (CPU training, a data loader on each core), the write and the upload take what
training leaves idle instead of slowing its steps. A nice value alone is not enough: a
nice-10 thread waking from I/O still preempts a training thread; a SCHED_IDLE one never
does (on this 2-core machine the stall bench's DDP stall went from 0.17 to 0.07 of sync).

A write that hangs (a stuck file system, a collective waiting on a peer that will never
come) must not hang the run: whoever waits for it gives up once the folder has gained no
byte for `checkpoint.stuck_write_s` and raises `CheckpointStuck`, which fails the attempt
(the run restarts from the last complete checkpoint). The judging is done by a watch
thread at the training thread's priority (`watch_writes`): the waiter is the upload
thread, which runs under SCHED_IDLE, and while training keeps every core busy it gets no
CPU for as long as training runs, so a hung write used to be judged only after the last
step. The watch's verdict sets the flag every later save checks (`wait_unless_stuck`).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
"""A checkpoint's own record (step, world size, layout), written last before its manifests;
here, below the strategies, so that DeepSpeed's resume check reads its name too."""

Writer = Callable[[], None]
"""Writes what a part staged; runs on the background thread."""


Buffers = WeakIdKeyDictionary
"""Host copies kept from one checkpoint to the next (`Stager`), by the storage they copy."""


def _copy_of(t: torch.Tensor, pin: bool, buffers: Buffers | None) -> torch.Tensor:
    if buffers is not None:
        kept = buffers.get(t.untyped_storage(), {})
        key = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        out = kept.get(key)
        if out is not None:
            return out.copy_(t, non_blocking=pin and t.device.type == "cuda")
    if pin and t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
    else:
        out = t.to("cpu", copy=True)
    if buffers is not None:
        buffers.setdefault(t.untyped_storage(), {})[key] = out
    return out


def snapshot(obj: Any, pin: bool = False, buffers: Buffers | None = None) -> Any:
    """A copy of a (nested) state dict whose tensors are host-memory copies, so the
    optimizer may step on while the copy is written. Containers are rebuilt, immutable
    leaves (numbers, strings, shapes) shared, any other object deep-copied. `pin` (GPUs)
    copies into page-locked memory. With `buffers` (a `Stager`'s), a tensor whose storage
    was copied before is copied into the same host memory again instead of new memory."""
    if isinstance(obj, torch.Tensor):
        return _copy_of(obj.detach(), pin, buffers)
    if isinstance(obj, dict):  # OrderedDict, defaultdict: the same type, a new object
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = snapshot(v, pin, buffers)
        return out
    if isinstance(obj, list):
        return [snapshot(v, pin, buffers) for v in obj]
    if type(obj) is tuple:
        return tuple(snapshot(v, pin, buffers) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(snapshot(v, pin, buffers) for v in obj))
    if obj is None or isinstance(obj, str | bytes | int | float | complex | torch.Size):
        return obj  # immutable leaves
    # Any other object (DeepSpeed's loss scaler, a set of names): a deep copy, or the step
    # after this one could change what the background thread writes.
    return copy.deepcopy(obj)


class Stager:
    """Keeps a part's staging copies from one checkpoint to the next, so that the next
    checkpoint copies into memory the process already holds. New memory is the dear part
    of a copy: on this project's 2-core VM touching 256 MB of fresh memory took 0.27 s,
    the same 256 MB again 0.07 s, and pinned memory is dearer still to allocate. The
    price is that the copy stays resident between checkpoints (the planner counts one
    staging copy per rank either way).

    A checkpoint `claim`s the buffers for its copies and `release`s them once its write
    has read them. One that comes while an earlier write still reads them gets None, and
    copies into new memory, as without a stager: a buffer is never overwritten while a
    write reads it. A write given up as hung never releases them."""

    def __init__(self) -> None:
        self._buffers = Buffers()
        self._lock = threading.Lock()
        self._claimed = False

    def claim(self) -> Buffers | None:
        with self._lock:
            if self._claimed:
                return None
            self._claimed = True
            return self._buffers

    def release(self, buffers: Buffers | None) -> None:
        if buffers is not None:
            with self._lock:
                self._claimed = False


def copy_done() -> None:
    """Wait for the device-to-host copies `snapshot(pin=True)` queued (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


_nice = 0
_idle = False
_training_thread: int | None = None


def set_background_priority(nice: int, idle: bool = False) -> None:
    """How background checkpoint threads yield the CPU: `idle`, the SCHED_IDLE policy
    (`checkpoint.background_idle`), and the nice value `nice`
    (`checkpoint.background_nice`). Called on the training thread, which
    `lower_priority` then never lowers."""
    global _nice, _idle, _training_thread
    _nice, _idle = nice, idle
    _training_thread = threading.get_ident()


def lower_priority() -> None:
    """Lower the calling thread's CPU priority to the background one: SCHED_IDLE when
    asked (the thread runs only on a core no other thread wants), and the background nice
    value. Linux keeps both per thread, and threads started afterwards from this one
    inherit them (the upload's transfer threads). Never called on the training thread:
    an unprivileged process cannot raise a priority back."""
    if not _idle and _nice <= 0:
        return
    if threading.get_ident() == _training_thread:
        log.warning("not lowering the training thread's priority")
        return
    tid = threading.get_native_id()
    if _idle and hasattr(os, "SCHED_IDLE"):
        try:
            if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # a seccomp profile, say: the nice value still applies
            log.debug("background SCHED_IDLE not set: %s", exc)
    if _nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < _nice:
            os.setpriority(os.PRIO_PROCESS, tid, _nice)
    except OSError as exc:  # a seccomp profile, say: run at training's priority
        log.debug("background nice %d not set: %s", _nice, exc)


def _lowered(write: Writer) -> Writer:
    def run() -> None:
        lower_priority()
        write()

    return run


class CheckpointStuck(RuntimeError):
    """A background checkpoint write made no progress for `checkpoint.stuck_write_s`."""


_stuck = threading.Event()
POLL_S = 1.0


def stuck() -> bool:
    """Whether a background write of this process was given up as hung: its thread may
    never return, so the process must exit without waiting for it (trainer.__main__)."""
    return _stuck.is_set()


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`: what a write in progress has put there so far."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # renamed into place meanwhile
                continue
    return total


def wait_progressing(
    future: Future[Any], folder: Path, stuck_s: float, what: str, watch: WriteWatch | None = None
) -> Any:
    """`future.result()`, unless the write it stands for is hung: once it runs, `folder`
    must gain bytes at least every `stuck_s` seconds (0: wait forever). A write still
    queued behind an earlier one is not judged (the earlier one's waiter judges that)."""
    if stuck_s <= 0:
        return future.result()
    seen, since = -1, time.monotonic()
    while True:
        done, _ = wait_futures([future], timeout=min(POLL_S, stuck_s))
        if done:
            return future.result()
        verdict = watch.verdict(folder) if watch is not None else None
        if verdict is not None:
            raise CheckpointStuck(f"{what}: {verdict}")
        now = time.monotonic()
        if not future.running():
            since = now
            continue
        size = folder_bytes(folder)
        if size != seen:
            seen, since = size, now
        elif now - since >= stuck_s:
            _stuck.set()
            raise CheckpointStuck(f"{what}: {_hung(now - since, size, folder, stuck_s)}")


def _hung(idle_s: float, size: int, folder: Path, stuck_s: float) -> str:
    return (
        f"its background write has added no byte for {idle_s:.0f} s ({size} bytes in "
        f"{folder}); giving it up as hung (checkpoint.stuck_write_s: {stuck_s:g}) so that "
        "this attempt fails and the run restarts from the last complete checkpoint"
    )


def wait_unless_stuck(future: Future[Any]) -> None:
    """Wait for `future` (an earlier save this one must follow) without outliving a write
    that another thread of this process has given up as hung."""
    while not future.done():
        if _stuck.is_set():
            raise CheckpointStuck("an earlier checkpoint's background write is hung")
        wait_futures([future], timeout=POLL_S)


class BackgroundWrites:
    """One writer thread per process, in submission order (a second checkpoint's files
    are never written before the first's), and the folders still being written."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raylift-ckpt-write")
        self._pending: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self.watch: WriteWatch | None = None  # set by the WriteWatch over these writes

    def submit(self, folder: Path, write: Writer) -> None:
        with self._lock:
            self._pending[os.path.realpath(folder)] = self._pool.submit(_lowered(write))

    def wait(self, folder: Path, stuck_s: float = 0.0, what: str = "checkpoint") -> None:
        """Return once `folder` is written (at once if it was written inline); raise the
        writer's error if it failed, and `CheckpointStuck` if the write, once started,
        gained no byte for `stuck_s` seconds (0: wait forever)."""
        with self._lock:
            future = self._pending.pop(os.path.realpath(folder), None)
        if future is not None:
            wait_progressing(future, folder, stuck_s, what, self.watch)

    def pending(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._pending.values())

    def running(self) -> list[str]:
        """The folders whose write is running now (not queued, not done)."""
        with self._lock:
            return [folder for folder, f in self._pending.items() if f.running()]


WRITES = BackgroundWrites()


class WriteWatch:
    """Judges running background writes from a thread of its own, started by the training
    thread and so of its priority: a running write whose folder gains no byte for the limit
    is given up as hung (its waiter raises, every later save raises) even while the
    SCHED_IDLE waiter gets no CPU. It wakes once a second and, with no write running,
    walks no folder."""

    def __init__(self, writes: BackgroundWrites) -> None:
        self._writes = writes
        writes.watch = self
        self._lock = threading.Lock()
        self._verdicts: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stuck_s = 0.0

    def start(self, stuck_s: float) -> None:
        self.stuck_s = stuck_s
        if stuck_s <= 0 or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name="raylift-ckpt-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def verdict(self, folder: Path | str) -> str | None:
        with self._lock:
            return self._verdicts.get(os.path.realpath(folder))

    def _run(self) -> None:
        progress: dict[str, tuple[int, float]] = {}
        while not self._stop.wait(min(POLL_S, max(self.stuck_s / 4, 0.05))):
            now, running = time.monotonic(), self._writes.running()
            for gone in set(progress) - set(running):
                del progress[gone]
            for folder in running:
                size = folder_bytes(Path(folder))
                seen, since = progress.get(folder, (-1, now))
                if size != seen:
                    progress[folder] = (size, now)
                elif now - since >= self.stuck_s > 0:
                    with self._lock:
                        self._verdicts.setdefault(
                            folder, _hung(now - since, size, Path(folder), self.stuck_s)
                        )
                    _stuck.set()


WATCH = WriteWatch(WRITES)


def watch_writes(stuck_s: float) -> None:
    """Start judging this process's background writes (`checkpoint.stuck_write_s`; 0:
    never). Call on the training thread: the watch thread takes its priority."""
    WATCH.start(stuck_s)


def submit(folder: Path, write: Writer) -> None:
    WRITES.submit(folder, write)


def wait_written(folder: Path, stuck_s: float = 0.0, what: str = "checkpoint") -> None:
    WRITES.wait(folder, stuck_s, what)
