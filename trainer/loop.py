"""The training loop: one function for every strategy and both runtimes.

It knows about steps. What wraps the model is the strategy's business, where checkpoints
go is the runtime's, and which blocks a rank reads is `trainer.data.blocks.BatchPlan`'s.
`train()` reads as the story of a run: load, start the attempt
(trainer.resilience.attempt: restore, metrics, journal, trackers), then for each step the
batch, forward and backward, the optimizer step, and the components that each decide
their own cadence: the preemption watch, the RAM tier, the step report with evaluation
(trainer.observability.evaluation), and publishing (trainer.checkpoint.publish: the
export, the checkpoint, the report to Ray).
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer import faults
from trainer.checkpoint.manager import TrainState
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.publish import Publish
from trainer.config import JobConfig
from trainer.data import packing
from trainer.data.blocks import PackedBlocks
from trainer.data.feed import TrainFeed, open_eval_sets
from trainer.distributed import hostsync
from trainer.distributed.seam import Runtime
from trainer.evaluation.component import Benchmarks
from trainer.model import attention
from trainer.model.loading import (
    check_device,
    load_tokenizer,
    local_model_dir,
    local_tokenizer_dir,
)
from trainer.observability.evaluation import Evaluation, all_reduce_sum, target_count
from trainer.observability.steps import StepReport
from trainer.resilience import journal as journal_mod
from trainer.resilience.attempt import checkpoint_manager, start_attempt
from trainer.resilience.preemption import PreemptionWatch
from trainer.storage import staging
from trainer.strategies.base import ModelSource, Strategy, build_strategy


@dataclass
class Prepared:
    """What the driver computed before starting workers; passed to every worker."""

    train_caches: list[str]
    """Every source's token cache, in data.train_file / eval_file order."""
    eval_caches: list[str] = field(default_factory=list)
    past_faults: dict[str, Any] = field(default_factory=dict)
    """The other runs under storage.path, read once by the driver: their faults and
    node-hours by pool (trainer.planner.fault_history.Reading.to_dict)."""

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
    `reduce`, how ranks sum host floats (trainer.distributed.hostsync: never waiting for a GPU).
    Counts come from the host's batch and the divisor goes to the device asynchronously,
    so the step makes no host-device synchronisation here."""
    count = count or (lambda batch: target_count(batch[1]))
    reduce = reduce or functools.partial(all_reduce_sum, device=device, world=world)
    local = sum(count(batch) for batch in micro)
    total, *agreed = reduce([float(local), *flags])
    return hostsync.to_device(max(total, 1.0) / world, device), agreed


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
    manager = checkpoint_manager(cfg, rt, strategy, scheduler, ts, prep.past_faults)
    memory = MemoryTier(cfg, rt, manager, device)  # the RAM tier: snapshots on peers
    start, report = start_attempt(cfg, rt, manager, memory, strategy, feed, ts, steps, end)
    attend = functools.partial(_attention, cfg=cfg, device=device)
    eval_sets = open_eval_sets(cfg, prep.eval_caches, feed.attention)
    benchmarks = Benchmarks(cfg, rt.rank, rt.world_size, strategy, tokenizer, device)
    evaluation = Evaluation(cfg, rt, strategy, device, eval_sets, attend, benchmarks)
    benchmarks.before_training(report, start)  # the scores' first point: step 0
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
                    out.update(evaluation.run(done, is_last))
            out.update(stats.gather())  # collective: per-worker memory and step phases
            return out

        metrics = report.report(step, loss, lr, grad_norm, started, ts.tokens_seen, extra)
        stats.device_phases.publishing(save, export)  # their device peak is their own
        stalled = time.perf_counter()  # export, checkpoint and report: the checkpoint stall
        saving = publish.after_step(step, metrics, export, save, emergency, is_last)
        stats.timer.add("ckpt", time.perf_counter() - stalled)
        memory.after_step(done, is_last)  # after the record: a restore never skips it
        faults.kill_after_step(
            rt.rank,
            rt.world_size,
            done,
            report.first_attempt,
            report.flush,
            rt.barrier,
            lambda: (memory.settle(), rt.wait_uploads()),
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
