"""The workers' entry points: each builds the `Runtime` for where it was started (Ray
Train or torchrun) and hands it to the loop. They live here, above the loop, so that the
loop and its components see only the `trainer.distributed.seam.Runtime` seam and never
import the runtimes, which import the checkpoint uploads and the journal."""

from __future__ import annotations

import gc
from typing import Any

import torch.distributed as dist

from trainer.config import JobConfig
from trainer.loop import Prepared, train
from trainer.observability.tracking import trackers
from trainer.runtime.worker import RayRuntime, TorchrunRuntime


def ray_worker(config: dict[str, Any]) -> None:
    """`train_loop_per_worker` for Ray Train's TorchTrainer."""
    from trainer.observability.logs import setup_logging

    setup_logging(ray_worker=True)
    cfg = JobConfig.model_validate(config["job"])
    try:
        train(cfg, Prepared(**config["prepared"]), RayRuntime(cfg))
    except BaseException:
        trackers.close_active("failed")
        raise


def torchrun_worker(cfg: JobConfig, prep: Prepared) -> dict[str, Any]:
    """The loop under torchrun: the trainer owns the process group, so it destroys it."""
    rt = TorchrunRuntime(cfg, cfg.backend)
    try:
        return train(cfg, prep, rt)
    except BaseException:
        trackers.close_active("failed")
        raise
    finally:
        if dist.is_initialized():
            # Whatever of the strategy a reference cycle still holds (a DDP reducer) goes
            # before the group: destroyed after it, at interpreter exit, it can abort the rank.
            gc.collect()
            dist.destroy_process_group()
