"""Where the loop runs: under Ray Train or under torchrun. The loop sees only `Runtime`.

Ray Train owns process-group setup, checkpoint upload/registration and pruning
(CheckpointConfig.num_to_keep). Under torchrun the trainer does those itself with the same
folder layout, so a run can move between the two and resume either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer import faults
from trainer.checkpoint import manager as ckpt_mod
from trainer.checkpoint.upload import upload_checkpoint
from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.resilience.journal import Journal
from trainer.storage import staging
from trainer.storage.local import scratch_dir
from trainer.storage.location import Location, download_dir, resolve
from trainer.storage.retry import retrying
from trainer.storage.transfer import prepare_uploads

log = logging.getLogger(__name__)


def run_location(cfg: JobConfig) -> Location:
    return resolve(cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region).join(
        cfg.run.name
    )


def init_process_group(backend: str, minutes: int = 30) -> None:
    """env:// process group for torchrun; oneCCL's bindings must be imported first."""
    if dist.is_initialized():
        return
    if backend == "ccl":
        # The ccl image runs oneCCL without its own launcher (CCL_PROCESS_LAUNCHER=none),
        # so each process tells it where it sits on its node.
        os.environ.setdefault("CCL_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
        os.environ.setdefault("CCL_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            raise UserError(
                "scaling.backend ccl: oneccl_bindings_for_pytorch is not installed "
                "(use the ccl image)"
            ) from None
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=minutes))


def is_torchrun_env() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


class Runtime:
    rank: int
    world_size: int
    local_rank: int
    run: Location
    allow_scratch: bool = False
    node_labels: dict[str, str] = {}  # noqa: RUF012 - replaced per instance
    journal: Journal | None = None  # rank 0 only
    retry_s: float = 300.0
    stuck_s: float = 600.0
    under_ray: bool = False  # Ray Train started this worker (trainer.distributed.seam)

    def latest_checkpoint(self) -> Path | None:
        raise NotImplementedError

    def report(
        self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None, kind: str = "periodic"
    ) -> bool:
        """Report metrics, and persist `ckpt_dir` as the checkpoint of `step` if given.
        Returns True when the runtime took the folder over (an async upload deletes it
        when done); otherwise the caller removes it."""
        raise NotImplementedError

    def uploads_in_flight(self) -> int:
        """Checkpoint uploads of this rank still running in the background."""
        return 0

    def wait_uploads(self) -> None:
        """Return once this rank's checkpoint uploads in flight have ended."""
        return None

    def finish(self) -> None:
        """The run's loop is done: wait for what still runs in the background."""
        return None

    def preemption(self) -> dict[str, Any] | None:
        """A pending preemption of one of this run's nodes ({"deadline_s": seconds left or
        None, "ranks": [...]}), else None. Collective: every rank calls it every step."""
        return None

    def wait_out_preemption(self, deadline_s: float | None) -> None:
        """After the emergency checkpoint: stop stepping (steps now would be lost) and
        wait for the runtime to tear this worker group down and restart it elsewhere."""
        return None

    def _upload(self, src: Path, step: int, kind: str) -> Location:
        """Persist a checkpoint folder (retrying transient errors) and journal it."""
        target = self.run.join(ckpt_mod.dir_name(step))
        started = time.monotonic()
        # The files a part staged are written in the background; a write that stops
        # making progress fails the upload, and with it the attempt.
        staging.wait_written(src, self.stuck_s, f"the checkpoint of step {step}")
        written_s = round(time.monotonic() - started, 3)

        def on_retry(n: int, exc: BaseException) -> None:
            journal = self._retry_journal()
            if journal is not None:
                journal.add("upload_retry", step=step, attempt=n, error=str(exc)[:300])

        def before_manifests() -> None:
            faults.hold(step, "upload", self.rank)
            faults.hold(step, "upload", self.rank, faults.HOLD_UPLOAD_ENV)

        upload_checkpoint(src, target, self.retry_s, on_retry, before_manifests)
        if self._own_journal is not None:
            self._own_journal.flush()  # its retries, journaled while storage was away
        if self.journal is not None:
            self.journal.add(
                "checkpoint",
                step=step,
                kind=kind,
                save_s=self._save_s.pop(step, None),
                write_wait_s=written_s,
                upload_s=round(time.monotonic() - started - written_s, 3),
            )
        if self.on_persisted is not None:  # the cadence's write floor
            self.on_persisted("storage", time.monotonic() - started)
        return target

    def _retry_journal(self) -> Journal | None:
        """Rank 0's journal, or this rank's own, made at its first upload retry: each rank
        uploads its share, and the one that meets an outage may be any of them."""
        if self.journal is not None or not self.journaling:
            return self.journal
        if self._own_journal is None:
            self._own_journal = Journal(self.run, f"{self.attempt_key}-rank{self.rank}")
        return self._own_journal

    def _blocked(self, since: float, kind: str, waited_for_slot: bool = False) -> None:
        """Tell the cadence how long an upload held the training thread since `since`: a
        synchronous periodic upload is part of its save's stall; a wait for an upload
        slot, or the last or emergency checkpoint's upload, is not a cost of the
        intervals (the step's time is measured without either)."""
        if self.on_blocked is not None:
            periodic_sync = kind == "periodic" and not waited_for_slot
            self.on_blocked(time.monotonic() - since, "storage" if periodic_sync else None)

    def note_save(self, step: int, seconds: float) -> None:
        self._save_s[step] = round(seconds, 3)

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def __init__(self) -> None:
        self._fetched: list[Path] = []
        self._save_s: dict[int, float] = {}
        self.began = time.time()  # the worker process began: capacity arrived (goodput)
        self.on_persisted: Any = None  # (tier, seconds) of each checkpoint's write + upload
        self.on_blocked: Any = None  # (seconds, tier or None) an upload held the step back
        self.journaling = False
        self.attempt_key = f"attempt-{int(time.time() * 1000)}"
        self._own_journal: Journal | None = None  # a rank > 0's, for its upload retries

    def _storage_settings(self, cfg: JobConfig) -> None:
        """What both runtimes take from the config once the rank is known: the run's
        location (its S3 client built now, not in the middle of training), the checkpoint
        settings, and rank 0's journal."""
        self.run = run_location(cfg)
        prepare_uploads(self.run)
        self.allow_scratch = cfg.checkpoint.allow_restart_from_scratch
        self.retry_s = cfg.checkpoint.upload_retry_s
        self.stuck_s = cfg.checkpoint.stuck_write_s
        staging.watch_writes(self.stuck_s)  # on the training thread: its priority
        self.sync_upload = cfg.checkpoint.upload == "sync"
        self.journaling = not cfg.train.as_test
        if self.rank == 0 and self.journaling:
            self.journal = Journal(self.run, f"{self.attempt_key}-rank0")

    def _fetch(self, loc: Location) -> Path:
        """A local path for a checkpoint: in place on a local/shared FS, else a temp copy
        that `release_fetched` removes."""
        if not loc.is_s3:
            return Path(loc.path)
        dest = scratch_dir("raylift-resume-")
        self._fetched.append(dest)
        return download_dir(loc, dest)

    def release_fetched(self) -> None:
        for path in self._fetched:
            shutil.rmtree(path, ignore_errors=True)
        self._fetched = []

    def _patient(self, loc: Location) -> Location:
        """`loc` on a filesystem that retries transient errors for `retry_s`: an attempt
        that starts while object storage is briefly down waits for it, as uploads do,
        instead of failing the run on its first listing."""
        if not loc.is_s3:
            return loc
        return dataclasses.replace(loc, fs=retrying(loc.fs, self.retry_s))

    def _from_storage(self) -> Path | None:
        loc = ckpt_mod.find_latest(self._patient(self.run), self.allow_scratch)
        return self._fetch(loc) if loc is not None else None


class RayRuntime(Runtime):
    under_ray = True

    def __init__(self, cfg: JobConfig):
        import ray
        import ray.train

        super().__init__()
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.local_rank = ctx.get_local_rank()
        self._storage_settings(cfg)
        self.node_labels = dict(ray.get_runtime_context().get_node_labels())
        self._slots = threading.BoundedSemaphore(cfg.checkpoint.max_uploads_in_flight)
        self._in_flight = 0
        self._in_flight_lock = threading.Condition()  # notified as each upload ends

    def latest_checkpoint(self) -> Path | None:
        """The newer of Ray's registered checkpoint and the newest complete one in
        storage. Ray registers a checkpoint only when its controller next polls the
        workers (every ~2 s), so a worker killed just after every rank finished uploading
        leaves a complete checkpoint that Ray does not know yet: resuming from Ray's
        would retrain a whole interval for nothing."""
        import ray.train

        run = self._patient(self.run)
        newest = ckpt_mod.find_latest(run, self.allow_scratch)
        reported = ray.train.get_checkpoint()
        if reported is not None:
            loc = dataclasses.replace(
                run,  # our own filesystem: Ray may hand its retrying wrapper of another
                path=reported.path,
                uri=("s3://" + reported.path) if self.run.is_s3 else reported.path,
            )
            state, why = ckpt_mod.completeness(loc)
            if state is None:
                raise ckpt_mod.CheckpointError(
                    f"{loc.uri}: Ray's latest checkpoint is incomplete ({why}); refusing to "
                    "train from scratch over it"
                )
            if newest is None or ckpt_mod.step_of(newest) <= ckpt_mod.step_of(loc):
                return self._fetch(loc)
            log.info("resuming from %s, newer than Ray's registered %s", newest.uri, loc.uri)
        return self._fetch(newest) if newest is not None else None

    def report(
        self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None, kind: str = "periodic"
    ) -> bool:
        import ray.train
        from ray.train import CheckpointUploadMode

        clean = {k: v for k, v in metrics.items() if v is not None}
        if ckpt_dir is None:
            ray.train.report(clean)
            return False
        checkpoint = ray.train.Checkpoint.from_directory(str(ckpt_dir))

        def persist(ckpt: Any, name: str) -> Any:
            target = self._upload(Path(ckpt.path), step, kind)
            # Registered on Ray's own view of the storage (it may wrap the filesystem).
            storage_fs = ray.train.get_context().get_storage().storage_filesystem
            return ray.train.Checkpoint(path=target.path, filesystem=storage_fs)

        # The emergency checkpoint on a spot notice, and the last one, are waited for.
        if self.sync_upload or kind != "periodic":
            began = time.monotonic()
            ray.train.report(
                clean,
                checkpoint=checkpoint,
                checkpoint_dir_name=ckpt_mod.dir_name(step),
                checkpoint_upload_fn=persist,
            )
            self._blocked(began, kind)
            return False
        # Bounded: with max_uploads_in_flight uploads queued or running, the next
        # checkpoint waits here (training is then faster than storage).
        waited = time.monotonic()
        self._slots.acquire()
        self._blocked(waited, kind, waited_for_slot=True)
        if time.monotonic() - waited > 1.0:
            log.info("waited %.1f s for an upload slot", time.monotonic() - waited)

        with self._in_flight_lock:
            self._in_flight += 1

        def persist_async(ckpt: Any, name: str) -> Any:
            staging.lower_priority()  # Ray's thread for checkpoint uploads only
            try:
                return persist(ckpt, name)
            finally:
                with self._in_flight_lock:
                    self._in_flight -= 1
                    self._in_flight_lock.notify_all()
                self._slots.release()

        ray.train.report(
            clean,
            checkpoint=checkpoint,
            checkpoint_dir_name=ckpt_mod.dir_name(step),
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=True,
            checkpoint_upload_fn=persist_async,
        )
        return True

    def uploads_in_flight(self) -> int:
        with self._in_flight_lock:
            return self._in_flight

    def wait_uploads(self) -> None:
        with self._in_flight_lock:
            self._in_flight_lock.wait_for(lambda: self._in_flight == 0)

    def preemption(self) -> dict[str, Any] | None:
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        left = None if info.deadline_ms is None else info.deadline_ms / 1000.0 - time.time()
        return {"deadline_s": left, "ranks": list(info.preempted_ranks)}

    def wait_out_preemption(self, deadline_s: float | None) -> None:
        # Ray Train restarts the worker group when every rank has left or the drain
        # deadline has passed; returning would end the run as finished, so wait. Past
        # the deadline plus a margin, something is wrong: fail loudly rather than hang.
        limit = time.monotonic() + (deadline_s if deadline_s is not None else 120.0) + 120.0
        log.info("emergency checkpoint done; waiting for the restart off the preempted node")
        while time.monotonic() < limit:
            time.sleep(0.5)
        raise RuntimeError("preempted node was not reclaimed and no restart came in time")


class TorchrunRuntime(Runtime):
    """torchrun / Slurm / Kubernetes: env:// rendezvous, the trainer persists checkpoints."""

    def __init__(self, cfg: JobConfig, backend: str):
        super().__init__()
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.keep_last = cfg.checkpoint.keep_last
        self._storage_settings(cfg)
        self.max_in_flight = cfg.checkpoint.max_uploads_in_flight
        self._uploads: list[Future[None]] = []
        self._uploader: ThreadPoolExecutor | None = None
        self._upload_group: Any = None
        if self.world_size > 1:
            init_process_group(backend)
            if not self.sync_upload:
                # The background uploads' barriers run on a gloo group of their own, so
                # they never interleave with the training collectives of the main thread.
                self._upload_group = dist.new_group(backend="gloo")

    def latest_checkpoint(self) -> Path | None:
        return self._from_storage()

    def report(
        self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None, kind: str = "periodic"
    ) -> bool:
        """Periodic checkpoints upload in the background (one thread per rank, in order, at
        most `max_uploads_in_flight` queued or running: the next one waits here); the last
        one, and every one with checkpoint.upload sync, is waited for."""
        if ckpt_dir is None:
            return False
        if self.sync_upload or kind != "periodic":
            began = time.monotonic()
            self.wait_uploads()  # in order: the earlier ones first
            self._blocked(began, kind, waited_for_slot=True)
            began = time.monotonic()
            self._persist(ckpt_dir, step, kind, group=None)
            self._blocked(began, kind)
            return False
        self._reap()
        waited = time.monotonic()
        while len(self._uploads) >= self.max_in_flight:
            self._uploads.pop(0).result()
        self._blocked(waited, kind, waited_for_slot=True)
        if time.monotonic() - waited > 1.0:
            log.info("waited %.1f s for an upload slot", time.monotonic() - waited)
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(1, thread_name_prefix="raylift-upload")

        def persist() -> None:
            staging.lower_priority()
            try:
                self._persist(ckpt_dir, step, kind, group=self._upload_group)
            finally:
                shutil.rmtree(ckpt_dir, ignore_errors=True)

        self._uploads.append(self._uploader.submit(persist))
        return True

    def _persist(self, ckpt_dir: Path, step: int, kind: str, group: Any) -> None:
        def barrier() -> None:
            if dist.is_initialized() and self.world_size > 1:
                dist.barrier(group=group)

        target = self.run.join(ckpt_mod.dir_name(step))
        if self.rank == 0 and target.fs.get_file_info(target.path).type.name == "Directory":
            # Only a torn leftover can be here: a complete one at this step would have been
            # resumed from. Clear it so old files cannot pass for new ones.
            target.fs.delete_dir(target.path)
        barrier()
        self._upload(ckpt_dir, step, kind)
        barrier()
        if self.rank == 0:
            state, why = ckpt_mod.completeness(target)
            if state is None:
                raise ckpt_mod.CheckpointError(f"{target.uri}: upload incomplete ({why})")
            ckpt_mod.prune(self.run, self.keep_last)
        barrier()

    def _reap(self) -> None:
        """Drop finished uploads; one that failed fails the run here, on the main thread
        (torchrun then stops every rank), rather than training on without checkpoints."""
        done = [f for f in self._uploads if f.done()]
        self._uploads = [f for f in self._uploads if not f.done()]
        for f in done:
            f.result()

    def uploads_in_flight(self) -> int:
        self._reap()
        return len(self._uploads)

    def wait_uploads(self) -> None:
        while self._uploads:
            self._uploads.pop(0).result()

    def finish(self) -> None:
        self.wait_uploads()
        if self._uploader is not None:
            self._uploader.shutdown()
            self._uploader = None
