"""An attempt's start: everything between "the workers are up" and the first step.

A run is one or more attempts (a fault, a spot reclaim or a resubmission starts the next).
Each begins the same way: the checkpoint manager over the run's stateful parts; the
newest state restored (the RAM tier's snapshot if storage has none as new, else the
newest complete checkpoint, torn ones after it discarded); this attempt's metrics file,
its journal record (where it resumed and what the restart cost), the trackers and the
step report. The loop calls `checkpoint_manager` and `start_attempt` and then only steps.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer import faults
from trainer.checkpoint import manager as ckpt_mod
from trainer.checkpoint.manager import (
    CheckpointManager,
    Identity,
    RNGPart,
    SchedulerPart,
    StrategyPart,
    TrainState,
)
from trainer.checkpoint.memory import MemoryTier
from trainer.config import JobConfig
from trainer.distributed import hostsync
from trainer.distributed.seam import Runtime
from trainer.model import attention
from trainer.observability.metrics import (
    MetricsFile,
    active_params,
    lineage,
    peak_flops,
    read_records,
)
from trainer.observability.steps import StepReport
from trainer.observability.tracking.trackers import open_tracker
from trainer.observability.workerstats import WorkerStats
from trainer.planner import fault_history
from trainer.resilience import cadence_setup
from trainer.resilience import journal as journal_mod

if TYPE_CHECKING:
    from trainer.data.feed import TrainFeed
    from trainer.strategies.base import Strategy

log = logging.getLogger("trainer")


def checkpoint_manager(
    cfg: JobConfig,
    rt: Runtime,
    strategy: Strategy,
    scheduler: Any,
    ts: TrainState,
    past_runs: dict[str, Any] | None = None,
) -> CheckpointManager:
    """The run's checkpoints: the strategy's state, the scheduler and RNG, the train state,
    and the objective's own parts (online RL's rollout inside a num_iterations group),
    saved every checkpoint.every_steps (never in a smoke test)."""
    return CheckpointManager(
        Identity(
            strategy=strategy.name,
            layout=strategy.layout,
            adapter=cfg.model.adapter,
            global_batch=cfg.global_batch,
            block_size=cfg.data.block_size,
            run_name=cfg.run.name,
            reads=getattr(strategy, "reads_layouts", ()),
        ),
        {
            "strategy": StrategyPart(strategy),
            "scheduler": SchedulerPart(scheduler),
            "rng": RNGPart(cfg.train.seed, ts),
            **getattr(strategy.objective, "checkpoint_parts", dict)(),
        },
        ts,
        rt.rank,
        rt.world_size,
        every=cfg.checkpoint.every_steps,
        export_every=cfg.checkpoint.export_every,
        enabled=not cfg.train.as_test,
        cadence=cadence_setup.for_job(cfg, rt, past_runs),  # the intervals `auto` chooses
    )


def start_attempt(
    cfg: JobConfig,
    rt: Runtime,
    manager: CheckpointManager,
    memory: MemoryTier,
    strategy: Strategy,
    feed: TrainFeed,
    ts: TrainState,
    steps: int,
    end: int,
) -> tuple[int, StepReport]:
    """Restore the newest snapshot in the RAM tier if storage has none as new, else the
    newest complete checkpoint (torn ones after it are discarded), open this attempt's
    metrics file, journal and trackers, and say what this attempt will train."""
    device = memory.device
    faults.arm_rl_drills(strategy.objective, rt.run.uri, rt.rank, rt.world_size)
    restoring = time.monotonic()
    restored = memory.restore()
    resume_dir = None if restored else rt.latest_checkpoint()
    if resume_dir is not None:
        manager.restore(resume_dir)
        restored = ("storage", ts.step)
    restore_s = time.monotonic() - restoring if restored else 0.0
    start = ts.step
    if rt.rank == 0 and manager.enabled:
        ckpt_mod.discard_torn_after(rt.run, start)
    rt.barrier()

    where = (
        f"{restored[0]}:{ckpt_mod.dir_name(start)}" if restored and not resume_dir else resume_dir
    )
    metrics_file, history = _open_metrics(cfg, rt, start, where)
    if metrics_file is not None:
        _journal_attempt(
            rt,
            metrics_file.attempt,
            history,
            start,
            restored and restored[0],
            memory.newest_held,
            restore_s,
            fault_history.pool_record(
                rt.node_labels, rt.world_size, cfg.checkpoint.failure_rate_per_hour
            ),
        )
    # Watching the run (observability.tracking, observability.workerstats): every rank
    # measures, rank 0 gathers and hands the records to the trackers' background senders.
    reduce = hostsync.HostReduce(device, rt.world_size)  # step agreement off the GPU
    stats = WorkerStats(
        device,
        rt.rank,
        rt.world_size,
        cfg.tracking.per_rank_every,
        _ray_gauges(cfg, rt),
        group=reduce.group,
    )
    memory.timer = stats.timer  # the RAM tier's stall, a phase of its own ("snap")
    tracker = open_tracker(
        cfg,
        rt.run,
        rt.rank,
        metrics_file.attempt if metrics_file is not None else 1,
        start,
        lineage(history)[0],
    )
    if tracker.names:
        tracker.events(journal_mod.read(rt.run))
    n_params = strategy.param_count()  # the whole model's, under every layout
    n_active = active_params(n_params, strategy.model)  # MFU's: a token's experts only
    if rt.rank == 0:
        log.info(
            "training %s: %d params (%d active), steps %d→%d of %d, global batch %d × %d tokens, "
            "%d workers, strategy %s, adapter %s, %s attention (%s)",
            cfg.run.name,
            n_params,
            n_active,
            start,
            end,
            steps,
            feed.global_batch,
            cfg.data.block_size,
            rt.world_size,
            strategy.name,
            cfg.model.adapter,
            feed.attention,
            attention.for_job(cfg).impl,
        )
    peak = peak_flops(
        torch.cuda.get_device_name(device) if device.type == "cuda" else None, cfg.train.precision
    )
    if metrics_file is not None:  # what this attempt's MFU counts, the same under any layout
        metrics_file.write(
            {
                "event": "start",
                "attempt": metrics_file.attempt,
                "from_step": start,
                "world_size": rt.world_size,
                "params": n_params,
                "active_params": n_active,
                "peak_flops": peak,
            }
        )
    report = StepReport(
        rt=rt,
        log_every=cfg.train.log_every,
        steps=steps,
        steps_per_epoch=feed.steps_per_epoch,
        n_params=n_active,
        peak=peak,
        all_reduce=reduce,
        metrics_file=metrics_file,
        tracker=tracker,
        stats=stats,
    )
    return start, report


def _ray_gauges(cfg: JobConfig, rt: Runtime) -> Any:
    """Per-worker gauges for Ray's metrics (dashboard, Prometheus) on a Ray run."""
    if not cfg.tracking.ray_metrics or not rt.under_ray:
        return None
    from trainer.observability.workerstats import RayGauges

    try:
        return RayGauges(cfg.run.name, rt.rank)
    except Exception as exc:  # metrics must never stop training
        log.warning("Ray metrics not exported: %s", exc)
        return None


def _journal_attempt(
    rt: Runtime,
    attempt: int,
    history: list[dict[str, Any]],
    start: int,
    source: str | None,
    trained_to: int = -1,
    restore_s: float = 0.0,
    pool: dict[str, Any] | None = None,
) -> None:
    """The attempt's first journal record: where it resumed (`restored_from`: storage,
    memory-own, memory-buddy; None from scratch), and what the restart cost (steps
    trained past that point, and the wall time since the last step). `history` is the
    metrics file as earlier attempts left it; `trained_to`, a step known trained beyond
    it (the RAM tier's newest snapshot), -1 if none. `began` (when the worker process
    started) and `restore_s` split the time before it for goodput. `pool`: the nodes it
    runs on, for later runs' failure rates (trainer.planner.fault_history)."""
    if rt.journal is None:
        return
    previous = [r for r in history if r.get("event") == "train"]
    # the steps that had survived every earlier resume: a step lost to an earlier fault was
    # counted then (a second fault resuming before it would count it twice)
    survived = lineage(history)[0]
    last_step = max(max((int(r["step"]) for r in survived), default=start), trained_to)
    last_time = max((float(r["time"]) for r in previous), default=None)
    trained = [  # earlier attempts' rank 0 (other ranks journal only upload retries)
        r
        for r in journal_mod.read(rt.run)
        if r["source"].startswith("attempt-") and r["source"].endswith("-rank0")
    ]
    after = "failure" if trained else "start"
    if trained and trained[-1]["event"] in ("stopped", "finished"):
        after = "stop"  # resubmitted after a clean stop: nothing lost
        last_step, last_time = start, None
    rt.journal.add(
        "attempt",
        after=after,
        attempt=attempt,
        world_size=rt.world_size,
        from_step=start,
        restored_from=source or None,
        lost_steps=max(0, last_step - start),
        lost_s=None if last_time is None else round(time.time() - last_time, 3),
        began=getattr(rt, "began", None),
        restore_s=round(restore_s, 3),
        pool=pool,
    )


def _open_metrics(
    cfg: JobConfig, rt: Runtime, start: int, resume_dir: Path | str | None
) -> tuple[MetricsFile | None, list[dict[str, Any]]]:
    """Rank 0's metrics file for this attempt, and the records earlier attempts wrote."""
    if rt.rank != 0 or cfg.train.as_test:
        return None, []  # a smoke test leaves no history that a real run would inherit
    loc = rt.run.join("metrics.jsonl")
    previous = read_records(loc)
    mf = MetricsFile(loc, previous)
    mf.attempt = 1 + max((int(r.get("attempt", 0)) for r in previous), default=0)
    if previous:
        mf.write(
            {
                "event": "resume",
                "attempt": mf.attempt,
                "from_step": start,
                "checkpoint": str(resume_dir) if resume_dir else None,
            }
        )
        mf.flush()
    return mf, previous
