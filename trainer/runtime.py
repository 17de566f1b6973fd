"""Where the loop runs: under Ray Train or under torchrun. The loop sees only `Runtime`.

Ray Train owns process-group setup, checkpoint upload/registration and pruning
(CheckpointConfig.num_to_keep). Under torchrun the trainer does those itself with the same
folder layout, so a run can move between the two and resume either way.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer import checkpoint as ckpt_mod
from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.storage import Location, download_dir, resolve, upload_dir

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

    def latest_checkpoint(self) -> Path | None:
        raise NotImplementedError

    def report(self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def __init__(self) -> None:
        self._fetched: list[Path] = []

    def _fetch(self, loc: Location) -> Path:
        """A local path for a checkpoint: in place on a local/shared FS, else a temp copy
        that `release_fetched` removes."""
        if not loc.is_s3:
            return Path(loc.path)
        dest = Path(tempfile.mkdtemp(prefix="raylift-resume-"))
        self._fetched.append(dest)
        return download_dir(loc, dest)

    def release_fetched(self) -> None:
        for path in self._fetched:
            shutil.rmtree(path, ignore_errors=True)
        self._fetched = []

    def _from_storage(self) -> Path | None:
        loc = ckpt_mod.find_latest(self.run, self.allow_scratch)
        return self._fetch(loc) if loc is not None else None


class RayRuntime(Runtime):
    def __init__(self, cfg: JobConfig):
        import ray
        import ray.train

        super().__init__()
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.local_rank = ctx.get_local_rank()
        self.run = run_location(cfg)
        self.allow_scratch = cfg.checkpoint.allow_restart_from_scratch
        self.node_labels = dict(ray.get_runtime_context().get_node_labels())

    def latest_checkpoint(self) -> Path | None:
        """The newer of Ray's registered checkpoint and the newest complete one in
        storage. Ray registers a checkpoint only when its controller next polls the
        workers (every ~2 s), so a worker killed just after every rank finished uploading
        leaves a complete checkpoint that Ray does not know yet: resuming from Ray's
        would retrain a whole interval for nothing."""
        import ray.train

        newest = ckpt_mod.find_latest(self.run, self.allow_scratch)
        reported = ray.train.get_checkpoint()
        if reported is not None:
            loc = Location(
                reported.filesystem,
                reported.path,
                ("s3://" + reported.path) if self.run.is_s3 else reported.path,
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

    def report(self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        import ray.train

        clean = {k: v for k, v in metrics.items() if v is not None}
        if ckpt_dir is None:
            ray.train.report(clean)
            return
        ray.train.report(
            clean,
            checkpoint=ray.train.Checkpoint.from_directory(str(ckpt_dir)),
            checkpoint_dir_name=ckpt_mod.dir_name(step),
        )


class TorchrunRuntime(Runtime):
    """torchrun / Slurm / Kubernetes: env:// rendezvous, the trainer persists checkpoints."""

    def __init__(self, cfg: JobConfig, backend: str):
        super().__init__()
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.keep_last = cfg.checkpoint.keep_last
        self.run = run_location(cfg)
        self.allow_scratch = cfg.checkpoint.allow_restart_from_scratch
        if self.world_size > 1:
            init_process_group(backend)

    def latest_checkpoint(self) -> Path | None:
        return self._from_storage()

    def report(self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        if ckpt_dir is None:
            return
        target = self.run.join(ckpt_mod.dir_name(step))
        if self.rank == 0 and target.fs.get_file_info(target.path).type.name == "Directory":
            # Only a torn leftover can be here: a complete one at this step would have been
            # resumed from. Clear it so old files cannot pass for new ones.
            target.fs.delete_dir(target.path)
        self.barrier()
        upload_dir(ckpt_dir, target)
        self.barrier()
        if self.rank == 0:
            state, why = ckpt_mod.completeness(target)
            if state is None:
                raise ckpt_mod.CheckpointError(f"{target.uri}: upload incomplete ({why})")
            ckpt_mod.prune(self.run, self.keep_last)
        self.barrier()
