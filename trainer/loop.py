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
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

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
from trainer.checkpoint.upload import upload_dir
from trainer.config import JobConfig
from trainer.data import packing
from trainer.data.blocks import BatchPlan, PackedBlocks, StepBatches, eval_indices
from trainer.data.mixing import MixedBatches, MixPlan
from trainer.data.tokenize import IGNORE, TokenCache
from trainer.errors import UserError
from trainer.model.loading import (
    check_device,
    count_params,
    load_tokenizer,
    local_model_dir,
    local_tokenizer_dir,
)
from trainer.observability.metrics import MetricsFile, lineage, mfu, peak_flops, read_records
from trainer.observability.tracking import trackers
from trainer.observability.tracking.trackers import open_tracker
from trainer.observability.workerstats import WorkerStats
from trainer.resilience import faults
from trainer.resilience import journal as journal_mod
from trainer.runtime.worker import RayRuntime, Runtime, TorchrunRuntime
from trainer.strategies.base import ModelSource, Strategy, build_strategy

log = logging.getLogger("trainer")

REPORT_EVERY_S = 5.0
"""Seconds between metric-only ray.train.report calls; every step still goes to the
metrics file and the log, and every checkpoint is reported at once."""

PREEMPTION_CHECK_S = 1.0
"""Seconds between asks for a preemption notice. Ray Train's get_preemption_info() is a
barrier through its synchronization actor (two actor calls per rank), too dear for every
step; Ray itself polls for node drains every 5 s, and a spot notice gives two minutes."""


@dataclass
class Prepared:
    """What the driver computed before starting workers; passed to every worker."""

    train_cache: str
    eval_cache: str | None
    # Every source's cache, in data.train_file / eval_file order (one source: [train_cache]).
    train_caches: list[str] = field(default_factory=list)
    eval_caches: list[str] = field(default_factory=list)

    def train_list(self) -> list[str]:
        return self.train_caches or [self.train_cache]

    def eval_list(self) -> list[str]:
        return self.eval_caches or ([self.eval_cache] if self.eval_cache else [])


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
    micro: list[tuple[Any, ...]], device: torch.device, world: int, flags: list[float]
) -> tuple[torch.Tensor, list[float]]:
    """The loss divisor that makes a step's loss the mean over every target token of the
    global batch (all micro-batches, all ranks): each micro-batch's loss is its token sum
    over this, and the strategies average the gradients over ranks. With masked prompts
    the micro-batches hold different numbers of targets, so a mean of per-batch means
    would weigh tokens unequally, and a batch of prompt tokens only would be NaN; a
    global batch with no target at all trains nothing (loss 0). The same all-reduce
    carries `flags` (summed over ranks), so a per-step decision costs no collective."""
    local = sum(_target_count(batch[1]) for batch in micro)
    total, *agreed = _all_reduce_sum([float(local), *flags], device, world)
    return torch.tensor(max(total, 1.0) / world, device=device), agreed


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
            len(blocks), cfg.train.micro_batch_size, replicas, replica, cfg.train.eval_batches
        ):
            ids, labels, *segs = blocks.gather(ix)
            x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
            loss = strategy.eval_loss(x, y, **_attention(segs, cfg, device))
            n = _target_count(y)  # the predictions the loss averaged over
            if n:  # a batch of prompt tokens only has no loss (HF returns NaN for it)
                loss_sum += loss * n
                count += n
    loss_sum, count = _all_reduce_sum([loss_sum, count], device, rt.world_size)
    return loss_sum, count


def attention_mode(cfg: JobConfig, train_meta: dict[str, Any]) -> str:
    """`data.attention` resolved for this corpus: auto is document attention for chat and
    prompt/completion rows, causal for plain text and under pipeline parallelism (whose
    stages build their own causal mask; the config refuses an explicit document there)."""
    setting = cfg.data.attention
    if setting == "auto" and getattr(cfg.strategy, "pp", 1) > 1:
        return "causal"
    return packing.resolve(setting, int(train_meta.get("chat_documents", 0)))


def _attention(segs: list[np.ndarray], cfg: JobConfig, device: torch.device) -> dict[str, Any]:
    """The model's attention arguments for a batch's segments (none: causal)."""
    if not segs:
        return {}
    seg = torch.from_numpy(segs[0]).to(device, non_blocking=True)
    return packing.attention_inputs(seg, cfg.model.attn_implementation)


def train(cfg: JobConfig, prep: Prepared, rt: Runtime) -> dict[str, Any]:
    device = check_device(cfg, rt.local_rank)
    seed_all(cfg.train.seed)
    staging.set_background_priority(cfg.checkpoint.background_nice, cfg.checkpoint.background_idle)
    # Local and shared-FS folders are used in place; S3 ones are fetched once per node.
    model_src = local_model_dir(cfg)
    tokenizer = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    strategy = build_strategy(cfg, device, rt.rank, rt.world_size)
    strategy.setup(ModelSource(model_src, len(tokenizer)))
    n_params = count_params(strategy.model)

    for cache in prep.train_list() + prep.eval_list():
        if cache and not (Path(cache) / "manifest.json").exists():
            raise UserError(
                f"tokenized data {cache} is not visible on worker node {socket.gethostname()}: "
                "put the data on the shared FS (EFS), mounted at the same path on every node"
            )
    train_caches = [TokenCache(Path(c)) for c in prep.train_list()]
    chats = sum(int(c.meta.get("chat_documents", 0)) for c in train_caches)
    attention = attention_mode(cfg, {"chat_documents": chats})
    documents = attention == "document"
    sources = [PackedBlocks(c, cfg.data.block_size, documents) for c in train_caches]
    train_blocks = sources[0]
    names = [s.name or "data" for s in cfg.data.sources("train")]
    # The global batch is fixed by the config; on fewer workers (an elastic run that lost
    # a node) each accumulates more micro steps, and the global sample order is unchanged.
    # Workers of one model-parallel group (tp × pp) read the same batches: one replica.
    replica, replicas = cfg.data_rank(rt.rank, rt.world_size)
    plan: BatchPlan | MixPlan
    if len(sources) == 1:
        plan = BatchPlan(
            len(train_blocks),
            cfg.train.micro_batch_size,
            cfg.grad_accum_for(rt.world_size),
            replicas,
            cfg.train.seed,
        )
    else:
        plan = MixPlan(
            [len(b) for b in sources],
            [s.weight for s in cfg.data.sources("train")],
            cfg.train.micro_batch_size,
            cfg.grad_accum_for(rt.world_size),
            replicas,
            cfg.train.seed,
        )
    if plan.steps_per_epoch < 1:
        raise UserError(
            f"{cfg.data.train_file}: {sum(len(b) for b in sources)} blocks of "
            f"{cfg.data.block_size} tokens are fewer than one global batch ({plan.global_batch})"
        )
    steps = total_steps(cfg, plan.steps_per_epoch)
    scheduler = build_scheduler(cfg, strategy.optimizer, steps)
    eval_sets = {
        s.name or "data": PackedBlocks(TokenCache(Path(c)), cfg.data.block_size, documents)
        for s, c in zip(cfg.data.sources("eval"), prep.eval_list(), strict=True)
    }

    ts = TrainState()
    manager = CheckpointManager(
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
    )
    resume_dir = rt.latest_checkpoint()
    if resume_dir is not None:
        manager.restore(resume_dir)
    start = ts.step
    if rt.rank == 0 and manager.enabled:
        ckpt_mod.discard_torn_after(rt.run, start)
    rt.barrier()

    metrics_file, history = _open_metrics(cfg, rt, start, resume_dir)
    if metrics_file is not None:
        _journal_attempt(rt, metrics_file.attempt, history, start)
    # Watching the run (observability.tracking, observability.workerstats): every rank
    # measures, rank 0 gathers and hands the records to the trackers' background senders.
    stats = WorkerStats(
        device, rt.rank, rt.world_size, cfg.tracking.per_rank_every, _ray_gauges(cfg, rt)
    )
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
    end = steps if cfg.train.stop_at_step is None else min(steps, cfg.train.stop_at_step)
    if rt.rank == 0:
        log.info(
            "training %s: %d params, steps %d→%d of %d, global batch %d × %d tokens, "
            "%d workers, strategy %s, adapter %s, %s attention",
            cfg.run.name,
            n_params,
            start,
            end,
            steps,
            plan.global_batch,
            cfg.data.block_size,
            rt.world_size,
            strategy.name,
            cfg.model.adapter,
            attention,
        )

    peak = peak_flops(
        torch.cuda.get_device_name(device) if device.type == "cuda" else None, cfg.train.precision
    )
    batches: StepBatches | MixedBatches
    if isinstance(plan, MixPlan):
        batches = MixedBatches(sources, plan, replica)
    else:
        batches = StepBatches(train_blocks, plan, replica)
    last: dict[str, Any] = {}
    strategy.model.train()
    window_start, window_tokens = time.perf_counter(), 0
    last_report = last_preemption_check = time.monotonic()
    preempted: dict[str, Any] | None = None
    for step in range(start, end):
        t0 = time.perf_counter()
        # Rank 0's clock decides when every rank asks Ray for a preemption notice.
        ask = rt.rank == 0 and time.monotonic() - last_preemption_check >= PREEMPTION_CHECK_S
        with stats.phase("data"):
            micro = batches.micro_batches(step)
            per_rank, (ask_preemption,) = _targets_per_rank(
                micro, device, rt.world_size, [float(ask)]
            )
        loss_acc = torch.zeros((), device=device)
        with stats.phase("fwd_bwd"):
            for m, (ids, labels, *segs) in enumerate(micro):
                x = torch.from_numpy(ids).to(device, non_blocking=True)
                y = torch.from_numpy(labels).to(device, non_blocking=True)
                extra = _attention(segs, cfg, device)
                with strategy.accumulating(m == len(micro) - 1):
                    loss_acc += strategy.train_micro(x, y, per_rank, **extra)
        with stats.phase("optim"):
            lr = scheduler.get_last_lr()[0]
            grad_norm = strategy.step()
            scheduler.step()
        stats.step_done()
        done = step + 1
        ts.step = done
        ts.tokens_seen += cfg.tokens_per_step
        window_tokens += cfg.tokens_per_step

        is_last = done == end
        # A spot notice (a node drain seen by Ray) checkpoints at once; Ray restarts the
        # group off the node after it, so the steps since the last checkpoint are kept.
        if preempted is None and not cfg.train.as_test and ask_preemption > 0:
            last_preemption_check = time.monotonic()
            preempted = rt.preemption()
            if preempted is not None and rt.rank == 0:
                log.warning(
                    "step %d: node preemption notice (ranks %s, %s s left): checkpointing now",
                    done,
                    preempted["ranks"],
                    "?" if preempted["deadline_s"] is None else f"{preempted['deadline_s']:.0f}",
                )
        emergency = preempted is not None and not is_last
        save = manager.due(done, end) or emergency
        export = manager.export_due(done, end, final=end == steps)
        log_now = done % cfg.train.log_every == 0 or is_last or save
        if not log_now and not export:
            continue
        # One all-reduce carries the loss, rank 0's "time to report to Ray" flag and each
        # rank's count of checkpoint uploads still running, so all ranks agree on when to
        # call ray.train.report (a barrier that waits for the controller's poll: per-step
        # calls would cost ~2 s each in Ray 2.60). Ray hands reports to its controller in
        # order, so a metrics report made while an async upload runs waits for that upload:
        # during a storage outage it would stop training until storage came back. Metrics
        # are reported once no rank has an upload running (the checkpoint's own report
        # carries its metrics meanwhile).
        due = float(rt.rank == 0 and time.monotonic() - last_report >= REPORT_EVERY_S)
        loss_sum, due, uploading = _all_reduce_sum(
            [float(loss_acc), due, float(rt.uploads_in_flight())], device, rt.world_size
        )
        due = float(due > 0 and uploading == 0)
        loss_val = loss_sum / rt.world_size
        now = time.perf_counter()
        tps = window_tokens / max(now - window_start, 1e-9)
        window_start, window_tokens = now, 0
        metrics: dict[str, Any] = {
            "step": done,
            "time": time.time(),
            "epoch": step // plan.steps_per_epoch,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "step_time_s": now - t0,
            "tokens_seen": ts.tokens_seen,
            "mfu": mfu(n_params, tps / rt.world_size, peak),
        }
        if isinstance(plan, MixPlan):
            seen = plan.counts_before(done) * cfg.data.block_size
            metrics.update({f"tokens_seen/{n}": int(t) for n, t in zip(names, seen, strict=True)})
        if eval_sets and (is_last or (cfg.train.eval_every and done % cfg.train.eval_every == 0)):
            with stats.phase("eval"):
                metrics.update(evaluate_all(strategy, eval_sets, cfg, rt, device))
        metrics.update(stats.gather())  # collective: per-worker memory and step phases
        last = metrics
        if metrics_file is not None:
            metrics_file.write({"event": "train", "attempt": metrics_file.attempt, **metrics})
        tracker.metrics(metrics)
        if rt.rank == 0:
            log.info(
                "step %d/%d loss %.4f lr %.3g tokens/s %.0f mfu %s%s",
                done,
                steps,
                loss_val,
                lr,
                tps,
                "n/a" if metrics["mfu"] is None else f"{metrics['mfu']:.1%}",
                f" eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else "",
            )
        stalled = time.perf_counter()  # export, checkpoint and report: the checkpoint stall
        if export:
            _export(rt, strategy, tokenizer, done)
            tracker.tag(
                "raylift.export", rt.run.join(ckpt_mod.EXPORT_DIR, ckpt_mod.dir_name(done)).uri
            )
        ckpt_dir = None
        if save:
            saving = time.monotonic()
            ckpt_dir = manager.save(
                {
                    "epoch": step // plan.steps_per_epoch,
                    "seed": cfg.train.seed,
                    "rank0_node_labels": rt.node_labels,
                    "metrics": {k: v for k, v in metrics.items() if v is not None},
                }
            )
            rt.note_save(done, time.monotonic() - saving)
            if rt.rank == 0 and metrics_file is not None:
                metrics_file.flush()
            tracker.flush()
        kind = "emergency" if emergency else ("final" if is_last else "periodic")
        owned = False
        try:
            if ckpt_dir is not None or due or is_last:
                owned = rt.report(metrics, done, ckpt_dir, kind)
                last_report = time.monotonic()
        finally:
            if ckpt_dir is not None and not owned:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        stats.timer.add("ckpt", time.perf_counter() - stalled)
        _drill_kill(rt, done, metrics_file, device)
        faults.hold(done, "train", rt.rank)
        if emergency:
            assert preempted is not None
            took = time.monotonic() - saving
            left = preempted["deadline_s"]
            if rt.rank == 0:
                log.warning(
                    "emergency checkpoint of step %d saved in %.1f s%s",
                    done,
                    took,
                    "" if left is None else f" of the {left:.0f} s left before the reclaim",
                )
                if rt.journal is not None:
                    rt.journal.add(
                        "preemption",
                        step=done,
                        ranks=preempted["ranks"],
                        deadline_s=left,
                        save_s=round(took, 3),
                        margin_s=None if left is None else round(left - took, 3),
                    )
            rt.wait_out_preemption(None if left is None else left - took)
        # Throughput is training throughput: eval and checkpoint time are not in the window.
        window_start = time.perf_counter()
    if rt.rank == 0 and metrics_file is not None:
        metrics_file.flush()
    if not cfg.train.as_test and end == steps and start < end:
        _write_probe(rt, strategy, train_blocks, device)
    rt.finish()
    if rt.journal is not None:
        rt.journal.add("finished" if end == steps else "stopped", step=end)
    if tracker.names:
        tracker.events(journal_mod.read(rt.run))
        tracker.close("finished" if end == steps else "stopped")
    rt.release_fetched()
    return last


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


def _drill_kill(rt: Runtime, done: int, metrics_file: Any, device: torch.device) -> None:
    """Fault drill: with RAYLIFT_FAULT_KILL_AFTER_STEP=N, the first attempt's last rank
    SIGKILLs itself once every rank has finished step N (its checkpoint reported, when N
    is a checkpoint step), as a spot reclaim or an OOM kill would. Ray restarts the group
    from the newest complete checkpoint (with checkpoint.upload: sync, N's own when N is
    a checkpoint step); between checkpoints the steps since then are trained again, which
    lets a test compare them with the first attempt's. The metrics are flushed first, so
    that comparison has both. N must be a logged step (train.log_every)."""
    at = os.environ.get("RAYLIFT_FAULT_KILL_AFTER_STEP", "")
    if not at or int(at) != done:
        return
    first = rt.rank == 0 and metrics_file is not None and metrics_file.attempt == 1
    if rt.rank == 0 and metrics_file is not None:
        metrics_file.flush()
    # Rank 0 knows which attempt this is; every rank must agree on whether to stop.
    (first_attempt,) = _all_reduce_sum([float(first)], device, rt.world_size)
    if not first_attempt:
        return
    if rt.rank == rt.world_size - 1:
        log.warning("RAYLIFT_FAULT_KILL_AFTER_STEP: killing rank %d after step %d", rt.rank, done)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    rt.barrier()  # the others wait here for the collective that fails


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


def _journal_attempt(rt: Runtime, attempt: int, history: list[dict[str, Any]], start: int) -> None:
    """The attempt's first journal record: where it resumed, and what the restart cost
    (steps trained past that checkpoint, and the wall time since the last step).
    `history` is the metrics file as earlier attempts left it."""
    if rt.journal is None:
        return
    previous = [r for r in history if r.get("event") == "train"]
    last_step = max((int(r["step"]) for r in previous), default=start)
    last_time = max((float(r["time"]) for r in previous), default=None)
    trained = [r for r in journal_mod.read(rt.run) if r["source"].startswith("attempt-")]
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
        lost_steps=max(0, last_step - start),
        lost_s=None if last_time is None else round(time.time() - last_time, 3),
    )


def _open_metrics(
    cfg: JobConfig, rt: Runtime, start: int, resume_dir: Path | None
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
