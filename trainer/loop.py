"""The training loop: one function for every strategy and both runtimes.

It knows about steps. What wraps the model is the strategy's business, where checkpoints
go is the runtime's, and which blocks a rank reads is `trainer.data.blocks.BatchPlan`'s.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint import cadence_setup, fault_history
from trainer.checkpoint import manager as ckpt_mod
from trainer.checkpoint.manager import (
    CheckpointManager,
    Identity,
    RNGPart,
    SchedulerPart,
    StrategyPart,
    TrainState,
    staging,
)
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.upload import upload_dir
from trainer.config import JobConfig
from trainer.data import packing
from trainer.data.blocks import PackedBlocks, eval_indices
from trainer.data.feed import TrainFeed, open_eval_sets
from trainer.data.tokenize import IGNORE
from trainer.model import attention
from trainer.model.loading import (
    check_device,
    load_tokenizer,
    local_model_dir,
    local_tokenizer_dir,
)
from trainer.observability.metrics import MetricsFile, lineage, peak_flops, read_records
from trainer.observability.steps import StepReport
from trainer.observability.tracking import trackers
from trainer.observability.tracking.trackers import open_tracker
from trainer.observability.workerstats import WorkerStats
from trainer.resilience import faults
from trainer.resilience import journal as journal_mod
from trainer.resilience.preemption import PreemptionWatch
from trainer.runtime import hostsync
from trainer.runtime.worker import RayRuntime, Runtime, TorchrunRuntime
from trainer.strategies.base import ModelSource, Strategy, build_strategy

log = logging.getLogger("trainer")


@dataclass
class Prepared:
    """What the driver computed before starting workers; passed to every worker."""

    train_caches: list[str]
    """Every source's token cache, in data.train_file / eval_file order."""
    eval_caches: list[str] = field(default_factory=list)
    past_faults: dict[str, Any] = field(default_factory=dict)
    """The other runs under storage.path, read once by the driver: their faults and
    node-hours by pool (trainer.checkpoint.fault_history.Reading.to_dict)."""

    @property
    def train_cache(self) -> str:
        """The first (or only) training source's cache."""
        return self.train_caches[0]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def total_steps(cfg: JobConfig, steps_per_epoch: int) -> int:
    if cfg.train.as_test:
        return 1
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * steps_per_epoch))


def lr_factor(step: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate at `step` as a fraction of optim.lr: a linear warmup from 0, then
    cosine down to min_ratio, linear down to 0, or constant. The same curves as Hugging
    Face's get_scheduler("cosine_with_min_lr" | "linear" | "constant_with_warmup"), checked
    against it in tests/unit/test_config.py; importing transformers.optimization pulls in
    peft and bitsandbytes, seconds of start-up for every worker of every attempt."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, cosine * (1 - min_ratio) + min_ratio)


def build_scheduler(cfg: JobConfig, optimizer: torch.optim.Optimizer, steps: int) -> Any:
    o = cfg.optim
    factor = functools.partial(
        lr_factor,
        schedule=o.schedule,
        warmup=min(o.warmup_steps, max(steps - 1, 0)),
        total=steps,
        min_ratio=o.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _target_count(labels: Any) -> int:
    """Predictions a causal-LM loss averages over: the labels after the one-token shift
    that are not IGNORE (numpy or torch)."""
    return int((labels[:, 1:] != IGNORE).sum())


def _targets_per_rank(
    micro: list[tuple[Any, ...]],
    device: torch.device,
    world: int,
    flags: list[float],
    count: Any = None,
    reduce: Any = None,
) -> tuple[torch.Tensor, list[float]]:
    """The loss divisor that makes a step's loss the mean over every target token of the
    global batch (all micro-batches, all ranks): each micro-batch's loss is its token sum
    over this, and the strategies average the gradients over ranks. With masked prompts
    the micro-batches hold different numbers of targets, so a mean of per-batch means
    would weigh tokens unequally, and a batch of prompt tokens only would be NaN; a
    global batch with no target at all trains nothing (loss 0). The same all-reduce
    carries `flags` (summed over ranks), so a per-step decision costs no collective.
    `count` is the objective's (target tokens for SFT, pairs for a preference loss);
    `reduce`, how ranks sum host floats (trainer.runtime.hostsync: never waiting for a GPU).
    Counts come from the host's batch and the divisor goes to the device asynchronously,
    so the step makes no host-device synchronisation here."""
    count = count or (lambda batch: _target_count(batch[1]))
    reduce = reduce or functools.partial(_all_reduce_sum, device=device, world=world)
    local = sum(count(batch) for batch in micro)
    total, *agreed = reduce([float(local), *flags])
    return hostsync.to_device(max(total, 1.0) / world, device), agreed


def _all_reduce_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def evaluate_all(
    strategy: Strategy,
    sets: dict[str, PackedBlocks],
    cfg: JobConfig,
    rt: Runtime,
    device: torch.device,
) -> dict[str, float]:
    """eval_loss over every eval source together (token-weighted), and with several
    sources, eval_loss/<name> for each."""
    parts = {name: _eval_sums(strategy, blocks, cfg, rt, device) for name, blocks in sets.items()}
    loss_sum = sum(s for s, _ in parts.values())
    count = sum(n for _, n in parts.values())
    loss = loss_sum / max(count, 1.0)
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
    if len(parts) > 1:
        out.update({f"eval_loss/{k}": s / max(n, 1.0) for k, (s, n) in parts.items()})
    return out


def _eval_sums(
    strategy: Strategy, blocks: PackedBlocks, cfg: JobConfig, rt: Runtime, device: torch.device
) -> tuple[float, float]:
    """(loss × targets, targets) summed over every rank's eval batches."""
    loss_sum, count = 0.0, 0.0
    replica, replicas = cfg.data_rank(rt.rank, rt.world_size)
    with strategy.evaluating():
        for ix in eval_indices(
            len(blocks), cfg.train.micro_batch_size, replicas, replica, cfg.train.eval_limit
        ):
            ids, labels, *segs = blocks.gather(np.maximum(ix, 0))
            labels[ix < 0] = IGNORE  # a place past the eval set: the forward, no loss
            x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
            loss = strategy.eval_loss(x, y, **_attention(segs, cfg, device))
            n = _target_count(y)  # the predictions the loss averaged over
            if n:  # a batch of prompt tokens only has no loss (HF returns NaN for it)
                loss_sum += loss * n
                count += n
    loss_sum, count = _all_reduce_sum([loss_sum, count], device, rt.world_size)
    return loss_sum, count


def _attention(segs: list[np.ndarray], cfg: JobConfig, device: torch.device) -> dict[str, Any]:
    """The model's attention arguments for a batch's segments (none: causal)."""
    if not segs:
        return {}
    seg = torch.from_numpy(segs[0]).to(device, non_blocking=True)
    attn = attention.for_job(cfg)
    return packing.attention_inputs(seg, attn.impl, **attn.mask_kwargs())


def train(cfg: JobConfig, prep: Prepared, rt: Runtime) -> dict[str, Any]:
    """Load; then for each step the batch, forward and backward, the optimizer step, and
    the components that decide their own cadence: the preemption check, the step report
    (with evaluation), checkpoint and export, the fault drills."""
    device = check_device(cfg, rt.local_rank)
    seed_all(cfg.train.seed)
    staging.set_background_priority(cfg.checkpoint.background_nice, cfg.checkpoint.background_idle)
    # Local and shared-FS folders are used in place; S3 ones are fetched once per node.
    tokenizer = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    strategy = build_strategy(cfg, device, rt.rank, rt.world_size)
    strategy.setup(ModelSource(local_model_dir(cfg), len(tokenizer)))
    objective = strategy.objective  # what a batch is and how its loss is made
    feed = objective.open_feed(prep.train_caches, prep.eval_caches, rt.rank, rt.world_size)
    objective.before_training(strategy, feed, rt)  # a precomputed reference, if one is due
    steps = total_steps(cfg, feed.steps_per_epoch)
    end = steps if cfg.train.stop_at_step is None else min(steps, cfg.train.stop_at_step)
    scheduler = build_scheduler(cfg, strategy.optimizer, steps)
    ts = TrainState()
    manager = _checkpoint_manager(cfg, rt, strategy, scheduler, ts, prep.past_faults)
    memory = MemoryTier(cfg, rt, manager, device)  # the RAM tier: snapshots on peers
    start, report = _start_attempt(cfg, rt, manager, memory, strategy, feed, ts, steps, end)
    evaluation = Evaluation(
        cfg, rt, strategy, device, open_eval_sets(cfg, prep.eval_caches, feed.attention)
    )
    preemption = PreemptionWatch(rt, enabled=not cfg.train.as_test, cadence=manager.cadence)
    publish = Publish(cfg, rt, strategy, tokenizer, manager, report)
    stats = report.stats
    strategy.model.train()
    for step in range(start, end):
        started = time.perf_counter()
        with stats.phase("data"):
            micro = feed.micro_batches(step)
            flags = [*preemption.ask(), *memory.ask()]
            per_rank, (asked, rebalanced, *snapped) = _targets_per_rank(
                micro, device, rt.world_size, flags, objective.count, report.all_reduce
            )
        with stats.phase("fwd_bwd"):
            loss = _forward_backward(strategy, micro, per_rank, cfg, device)
        with stats.phase("optim"):
            lr = scheduler.get_last_lr()[0]
            grad_norm = strategy.step()
            scheduler.step()
        stats.step_done()
        done = ts.step = step + 1
        ts.tokens_seen += cfg.tokens_per_step
        report.count(cfg.tokens_per_step)

        is_last = done == end
        preemption.check(asked, rebalanced, done)
        memory.agreed(snapped)  # the RAM tier's flags and the cadence's proposals
        emergency = preemption.emergency(is_last)
        save = manager.due(done, end) or emergency
        export = manager.export_due(done, end, final=end == steps)
        if not report.due(done, is_last, save) and not export:
            memory.after_step(done, is_last)  # a snapshot comes after the step's record
            continue

        def extra(done: int = done, is_last: bool = is_last) -> dict[str, Any]:
            out = feed.source_tokens(done)
            out.update(objective.metrics(report.all_reduce))  # collective
            if evaluation.due(done, is_last):
                with stats.phase("eval"):
                    out.update(evaluation.run())
            out.update(stats.gather())  # collective: per-worker memory and step phases
            return out

        metrics = report.report(step, loss, lr, grad_norm, started, ts.tokens_seen, extra)
        stats.device_phases.publishing(save, export)  # their device peak is their own
        stalled = time.perf_counter()  # export, checkpoint and report: the checkpoint stall
        saving = publish.after_step(step, metrics, export, save, emergency, is_last)
        stats.timer.add("ckpt", time.perf_counter() - stalled)
        memory.after_step(done, is_last)  # after the record: a restore never skips it
        faults.kill_after_step(
            rt.rank, rt.world_size, done, report.first_attempt, report.flush, rt.barrier
        )
        faults.hold(done, "train", rt.rank)
        if emergency:
            preemption.ride_out(done, saving)
        report.restart_window()
    memory.finish()
    _finish(cfg, rt, strategy, feed, report, device, start, end, steps)
    return report.last


def _forward_backward(
    strategy: Strategy,
    micro: list[tuple[Any, ...]],
    per_rank: torch.Tensor,
    cfg: JobConfig,
    device: torch.device,
) -> torch.Tensor:
    """Every micro batch of the step, gradients accumulated; the summed loss. The
    objective reads each batch (packed documents' segments become `_attention`'s mask)."""
    loss_acc = torch.zeros((), device=device)
    attend = functools.partial(_attention, cfg=cfg, device=device)
    for m, batch in enumerate(micro):
        x, y, extra = strategy.objective.inputs(batch, device, attend)
        with strategy.accumulating(m == len(micro) - 1):
            loss_acc += strategy.train_micro(x, y, per_rank, **extra)
    return loss_acc


class Evaluation:
    """eval_loss every train.eval_every steps and at the last step, when there are eval sets."""

    def __init__(
        self,
        cfg: JobConfig,
        rt: Runtime,
        strategy: Strategy,
        device: torch.device,
        sets: dict[str, PackedBlocks],
    ):
        self.cfg, self.rt, self.strategy, self.device, self.sets = cfg, rt, strategy, device, sets

    def due(self, done: int, is_last: bool) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.sets) and (is_last or bool(every and done % every == 0))

    def run(self) -> dict[str, float]:
        return evaluate_all(self.strategy, self.sets, self.cfg, self.rt, self.device)


def _checkpoint_manager(
    cfg: JobConfig,
    rt: Runtime,
    strategy: Strategy,
    scheduler: Any,
    ts: TrainState,
    past_runs: dict[str, Any] | None = None,
) -> CheckpointManager:
    """The run's checkpoints: the strategy's state, the scheduler and RNG, and the train
    state, saved every checkpoint.every_steps (never in a smoke test)."""
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
        },
        ts,
        rt.rank,
        rt.world_size,
        every=cfg.checkpoint.every_steps,
        export_every=cfg.checkpoint.export_every,
        enabled=not cfg.train.as_test,
        cadence=cadence_setup.for_job(cfg, rt, past_runs),  # the intervals `auto` chooses
    )


def _start_attempt(
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
    n_params = strategy.param_count()  # the whole model's, for MFU, under every layout
    if rt.rank == 0:
        log.info(
            "training %s: %d params, steps %d→%d of %d, global batch %d × %d tokens, "
            "%d workers, strategy %s, adapter %s, %s attention (%s)",
            cfg.run.name,
            n_params,
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
                "peak_flops": peak,
            }
        )
    report = StepReport(
        rt=rt,
        log_every=cfg.train.log_every,
        steps=steps,
        steps_per_epoch=feed.steps_per_epoch,
        n_params=n_params,
        peak=peak,
        all_reduce=reduce,
        metrics_file=metrics_file,
        tracker=tracker,
        stats=stats,
    )
    return start, report


class Publish:
    """What a reported step hands out, each when due: the user's export, the checkpoint,
    and the report to Ray (which owns the checkpoint folder once reported)."""

    def __init__(
        self,
        cfg: JobConfig,
        rt: Runtime,
        strategy: Strategy,
        tokenizer: Any,
        manager: CheckpointManager,
        report: StepReport,
    ):
        self.cfg, self.rt, self.strategy, self.tokenizer = cfg, rt, strategy, tokenizer
        self.manager, self.report = manager, report

    def after_step(
        self,
        step: int,
        metrics: dict[str, Any],
        export: bool,
        save: bool,
        emergency: bool,
        is_last: bool,
    ) -> float:
        """Returns when the checkpoint's save started (the emergency checkpoint's account)."""
        rt, report, done = self.rt, self.report, step + 1
        if export:
            _export(rt, self.strategy, self.tokenizer, done)
            report.tracker.tag(
                "raylift.export", rt.run.join(ckpt_mod.EXPORT_DIR, ckpt_mod.dir_name(done)).uri
            )
        ckpt_dir = None
        saving = time.monotonic()
        if save:
            ckpt_dir = self.manager.save(
                {
                    "epoch": step // report.steps_per_epoch,
                    "seed": self.cfg.train.seed,
                    "rank0_node_labels": rt.node_labels,
                    "metrics": {k: v for k, v in metrics.items() if v is not None},
                }
            )
            rt.note_save(done, time.monotonic() - saving)
            report.flush()
            report.tracker.flush()
        kind = "emergency" if emergency else ("final" if is_last else "periodic")
        owned = False
        try:
            if ckpt_dir is not None or report.ray_due or is_last:
                owned = rt.report(metrics, done, ckpt_dir, kind)
                report.reported_to_ray()
        finally:
            if ckpt_dir is not None and not owned:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        return saving


def _finish(
    cfg: JobConfig,
    rt: Runtime,
    strategy: Strategy,
    feed: TrainFeed,
    report: StepReport,
    device: torch.device,
    start: int,
    end: int,
    steps: int,
) -> None:
    """The last metrics written, the final probe (a run that trained to its end), the
    journal's last word and the trackers closed."""
    report.stats.device_phases.write_final(rt.run, rt.rank)  # each phase's device peak
    report.close()
    if not cfg.train.as_test and end == steps and start < end:
        _write_probe(rt, strategy, feed.first, device)
    rt.finish()
    if rt.journal is not None:
        rt.journal.add("finished" if end == steps else "stopped", step=end)
    if report.tracker.names:
        report.tracker.events(journal_mod.read(rt.run))
        report.tracker.close("finished" if end == steps else "stopped")
    rt.release_fetched()


def _ray_gauges(cfg: JobConfig, rt: Runtime) -> Any:
    """Per-worker gauges for Ray's metrics (dashboard, Prometheus) on a Ray run."""
    if not cfg.tracking.ray_metrics or not isinstance(rt, RayRuntime):
        return None
    from trainer.observability.workerstats import RayGauges

    try:
        return RayGauges(cfg.run.name, rt.rank)
    except Exception as exc:  # metrics must never stop training
        log.warning("Ray metrics not exported: %s", exc)
        return None


def _export(rt: Runtime, strategy: Strategy, tokenizer: Any, step: int) -> None:
    """The user's export, separate from resume state: written locally by the rank(s) that
    hold it, then uploaded to export/step_<N>/. Collective."""
    tmp = Path(tempfile.mkdtemp(prefix=f"raylift-export-{step}-r{rt.rank}-"))
    try:
        if strategy.export(tmp, rt.rank, tokenizer):
            target = rt.run.join(ckpt_mod.EXPORT_DIR, ckpt_mod.dir_name(step))
            upload_dir(tmp, target)
            if rt.rank == 0:
                log.info("exported step %d to %s", step, target.uri)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rt.barrier()


def _write_probe(
    rt: Runtime, strategy: Strategy, blocks: PackedBlocks, device: torch.device
) -> None:
    """Logits of the final in-memory model on a fixed input, written next to the
    checkpoints, so anyone can verify the export is the trained model. Collective."""
    x = torch.from_numpy(blocks.gather(np.array([0]))[0][:, :16]).to(device)
    with strategy.evaluating():
        logits = strategy.logits(x).float().cpu()
    if rt.rank == 0:
        loc = rt.run.join("final_probe.json")
        body = json.dumps({"input_ids": x.cpu().tolist(), "logits": logits.tolist()})
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(body.encode())


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
    runs on, for later runs' failure rates (trainer.checkpoint.fault_history)."""
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


# ------------------------------------------------------------------ entry points


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
