"""The training loop: one function for every strategy and both runtimes.

It knows about steps. What wraps the model is the strategy's business, where checkpoints
go is the runtime's, and which blocks a rank reads is `trainer.data.BatchPlan`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer import checkpoint as ckpt_mod
from trainer.config import JobConfig
from trainer.data import BatchPlan, PackedBlocks, StepBatches, TokenCache, eval_indices
from trainer.errors import UserError
from trainer.metrics import MetricsFile, mfu, peak_flops, read_records
from trainer.model import (
    check_device,
    count_params,
    load_model,
    load_tokenizer,
    local_model_dir,
    local_tokenizer_dir,
)
from trainer.runtime import RayRuntime, Runtime, TorchrunRuntime
from trainer.strategies import get_strategy, param_groups

log = logging.getLogger("trainer")

REPORT_EVERY_S = 5.0
"""Seconds between metric-only ray.train.report calls; every step still goes to the
metrics file and the log, and every checkpoint is reported at once."""


@dataclass
class Prepared:
    """What the driver computed before starting workers; passed to every worker."""

    train_cache: str
    eval_cache: str | None


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


def build_scheduler(cfg: JobConfig, optimizer: torch.optim.Optimizer, steps: int) -> Any:
    from transformers import get_scheduler

    o = cfg.optim
    warmup = min(o.warmup_steps, max(steps - 1, 0))
    if o.schedule == "cosine":
        return get_scheduler(
            "cosine_with_min_lr",
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=steps,
            scheduler_specific_kwargs={"min_lr_rate": o.min_lr_ratio},
        )
    if o.schedule == "linear":
        return get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)


def _autocast(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.train.precision == "fp32" or device.type != "cuda":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float16
    return torch.autocast(device_type="cuda", dtype=dtype)


def _all_reduce_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def evaluate(
    model: torch.nn.Module, blocks: PackedBlocks, cfg: JobConfig, rt: Runtime, device: torch.device
) -> dict[str, float]:
    """Token-weighted mean loss over the eval set (or its first eval_batches per rank)."""
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0.0
    with torch.no_grad():
        for ix in eval_indices(
            len(blocks), cfg.train.micro_batch_size, rt.world_size, rt.rank, cfg.train.eval_batches
        ):
            x = torch.from_numpy(blocks.gather(ix)).to(device)
            with _autocast(cfg, device):
                out = model(input_ids=x, labels=x)
            n = x.numel() - x.shape[0]  # predictions per block: block_size - 1
            loss_sum += float(out.loss) * n
            count += n
    loss_sum, count = _all_reduce_sum([loss_sum, count], device, rt.world_size)
    model.train(was_training)
    loss = loss_sum / max(count, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def train(cfg: JobConfig, prep: Prepared, rt: Runtime) -> dict[str, Any]:
    device = check_device(cfg)
    seed_all(cfg.train.seed)
    resume_dir = rt.latest_checkpoint()
    state: dict[str, Any] | None = None
    if resume_dir is not None:
        state = ckpt_mod.load_state(resume_dir)
        _check_resumable(cfg, state, resume_dir)
        tokenizer = load_tokenizer(resume_dir / "model", None)
        model_src = resume_dir / "model"
    else:
        # Local and shared-FS folders are used in place; S3 ones are fetched once per node.
        model_src = local_model_dir(cfg)
        tok_dir = local_tokenizer_dir(cfg)
        tokenizer = load_tokenizer(tok_dir, cfg.model.special_tokens)

    model = load_model(model_src, cfg, len(tokenizer))
    n_params = count_params(model)
    strategy = get_strategy(cfg.train.strategy, rt.world_size)
    model = strategy.wrap(model, device)
    o = cfg.optim
    optimizer = strategy.build_optimizer(
        model, param_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps
    )
    scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None

    for cache in (prep.train_cache, prep.eval_cache):
        if cache and not (Path(cache) / "meta.json").exists():
            raise UserError(
                f"tokenized data {cache} is not visible on worker node {socket.gethostname()}: "
                "put the data on the shared FS (EFS), mounted at the same path on every node"
            )
    train_blocks = PackedBlocks(TokenCache(Path(prep.train_cache)), cfg.data.block_size)
    plan = BatchPlan(
        len(train_blocks),
        cfg.train.micro_batch_size,
        cfg.train.grad_accum,
        rt.world_size,
        cfg.train.seed,
    )
    if plan.steps_per_epoch < 1:
        raise UserError(
            f"{cfg.data.train_file}: {len(train_blocks)} blocks of {cfg.data.block_size} tokens "
            f"are fewer than one global batch ({plan.global_batch})"
        )
    steps = total_steps(cfg, plan.steps_per_epoch)
    scheduler = build_scheduler(cfg, optimizer, steps)
    eval_blocks = (
        PackedBlocks(TokenCache(Path(prep.eval_cache)), cfg.data.block_size)
        if prep.eval_cache
        else None
    )

    start = 0
    tokens_seen = 0
    if state is not None and resume_dir is not None:
        strategy.load(model, optimizer, resume_dir, rt.rank)
        scheduler.load_state_dict(torch.load(resume_dir / "scheduler.pt", weights_only=False))
        if scaler is not None and (resume_dir / "scaler.pt").exists():
            scaler.load_state_dict(torch.load(resume_dir / "scaler.pt", weights_only=True))
        if not ckpt_mod.load_rng(resume_dir, rt.rank):
            log.warning(
                "no RNG state for rank %d in %s (world size changed); reseeding",
                rt.rank,
                resume_dir,
            )
            seed_all(cfg.train.seed + 1000 * state["step"] + rt.rank)
        start = int(state["step"])
        tokens_seen = int(state["tokens_seen"])

    metrics_file = _open_metrics(cfg, rt, start, resume_dir)
    end = steps if cfg.train.stop_at_step is None else min(steps, cfg.train.stop_at_step)
    if rt.rank == 0:
        log.info(
            "training %s: %d params, steps %d→%d of %d, global batch %d × %d tokens, "
            "%d workers, strategy %s",
            cfg.run.name,
            n_params,
            start,
            end,
            steps,
            plan.global_batch,
            cfg.data.block_size,
            rt.world_size,
            strategy.name,
        )

    peak = peak_flops(
        torch.cuda.get_device_name(device) if device.type == "cuda" else None, cfg.train.precision
    )
    batches = StepBatches(train_blocks, plan, rt.rank)
    every = cfg.checkpoint.every_steps
    last: dict[str, Any] = {}
    model.train()
    window_start, window_tokens = time.perf_counter(), 0
    last_report = time.monotonic()
    for step in range(start, end):
        t0 = time.perf_counter()
        micro = batches.micro_batches(step)
        loss_acc = torch.zeros((), device=device)
        for m, arr in enumerate(micro):
            x = torch.from_numpy(arr).to(device, non_blocking=True)
            with strategy.no_sync(model, m == len(micro) - 1), _autocast(cfg, device):
                loss = model(input_ids=x, labels=x).loss / len(micro)
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
            loss_acc += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = strategy.clip_grad_norm(model, o.grad_clip)
        lr = scheduler.get_last_lr()[0]
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        tokens_seen += cfg.tokens_per_step
        window_tokens += cfg.tokens_per_step

        is_last = done == end
        save = not cfg.train.as_test and ((every is not None and done % every == 0) or is_last)
        log_now = done % cfg.train.log_every == 0 or is_last or save
        if not log_now:
            continue
        # One all-reduce carries the loss and rank 0's "time to report to Ray" flag, so all
        # ranks agree on when to call ray.train.report (a barrier that waits for the
        # controller's poll: per-step calls would cost ~2 s each in Ray 2.60).
        due = float(rt.rank == 0 and time.monotonic() - last_report >= REPORT_EVERY_S)
        loss_sum, due = _all_reduce_sum([float(loss_acc), due], device, rt.world_size)
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
            "tokens_seen": tokens_seen,
            "mfu": mfu(n_params, tps / rt.world_size, peak),
        }
        if eval_blocks is not None and (
            is_last or (cfg.train.eval_every and done % cfg.train.eval_every == 0)
        ):
            metrics.update(evaluate(model, eval_blocks, cfg, rt, device))
        last = metrics
        if metrics_file is not None:
            metrics_file.write({"event": "train", "attempt": metrics_file.attempt, **metrics})
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
        ckpt_dir = None
        if save:
            ckpt_dir = _save(
                cfg,
                rt,
                strategy,
                model,
                optimizer,
                scheduler,
                scaler,
                tokenizer,
                done,
                tokens_seen,
                plan,
                metrics,
            )
            if rt.rank == 0 and metrics_file is not None:
                metrics_file.flush()
        try:
            if ckpt_dir is not None or due or is_last:
                rt.report(metrics, done, ckpt_dir)
                last_report = time.monotonic()
        finally:
            if ckpt_dir is not None:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        # Throughput is training throughput: eval and checkpoint time are not in the window.
        window_start = time.perf_counter()
    if rt.rank == 0 and metrics_file is not None:
        metrics_file.flush()
    if not cfg.train.as_test and end == steps and start < end:
        _write_probe(cfg, rt, model, train_blocks, device)
    rt.release_fetched()
    return last


def _write_probe(
    cfg: JobConfig, rt: Runtime, model: torch.nn.Module, blocks: PackedBlocks, device: torch.device
) -> None:
    """Logits of the final in-memory model on a fixed input, written next to the
    checkpoints, so anyone can verify the exported HF checkpoint is the trained model."""
    x = torch.from_numpy(blocks.gather(np.array([0]))[:, :16]).to(device)
    was_training = model.training
    model.eval()
    with torch.no_grad(), _autocast(cfg, device):
        logits = model(input_ids=x).logits.float().cpu()
    model.train(was_training)
    if rt.rank == 0:
        loc = rt.run.join("final_probe.json")
        body = json.dumps({"input_ids": x.cpu().tolist(), "logits": logits.tolist()})
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(body.encode())


def _open_metrics(
    cfg: JobConfig, rt: Runtime, start: int, resume_dir: Path | None
) -> MetricsFile | None:
    if rt.rank != 0 or cfg.train.as_test:
        return None  # a smoke test leaves no history that a real run would inherit
    loc = rt.run.join("metrics.jsonl")
    previous = read_records(loc)
    mf = MetricsFile(loc)
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
    return mf


def _check_resumable(cfg: JobConfig, state: dict[str, Any], where: Path) -> None:
    """Resuming with a different global batch would change which data each step reads."""
    if state.get("global_batch") != cfg.global_batch:
        raise UserError(
            f"{where}: checkpoint was trained with global batch {state.get('global_batch')}, "
            f"this config has {cfg.global_batch}; keep micro_batch_size × grad_accum × "
            "num_workers equal to resume, or use a new run.name"
        )
    if state.get("block_size") != cfg.data.block_size:
        raise UserError(
            f"{where}: checkpoint used block_size {state.get('block_size')}, config has "
            f"{cfg.data.block_size}; use a new run.name to change it"
        )


def _save(
    cfg: JobConfig,
    rt: Runtime,
    strategy: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    tokenizer: Any,
    step: int,
    tokens_seen: int,
    plan: BatchPlan,
    metrics: dict[str, Any],
) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"raylift-ckpt-{step}-r{rt.rank}-"))
    strategy.save(model, optimizer, out, rt.rank, tokenizer)
    (out / "rng").mkdir(exist_ok=True)
    torch.save(ckpt_mod.rng_state(), out / "rng" / f"rank_{rt.rank}.pt")
    if rt.rank == 0:
        torch.save(scheduler.state_dict(), out / "scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), out / "scaler.pt")
        state = {
            "step": step,
            "epoch": (step - 1) // plan.steps_per_epoch,
            "tokens_seen": tokens_seen,
            "world_size": rt.world_size,
            "global_batch": cfg.global_batch,
            "block_size": cfg.data.block_size,
            "strategy": strategy.name,
            "run_name": cfg.run.name,
            "rank0_node_labels": rt.node_labels,
            "metrics": {k: v for k, v in metrics.items() if v is not None},
        }
        (out / ckpt_mod.STATE_FILE).write_text(json.dumps(state, indent=2))
    ckpt_mod.write_manifest(out, rt.rank, before=set())
    return out


# ------------------------------------------------------------------ entry points


def ray_worker(config: dict[str, Any]) -> None:
    """`train_loop_per_worker` for Ray Train's TorchTrainer."""
    from trainer.logs import setup_logging

    setup_logging(ray_worker=True)
    cfg = JobConfig.model_validate(config["job"])
    train(cfg, Prepared(**config["prepared"]), RayRuntime(cfg))


def torchrun_worker(cfg: JobConfig, prep: Prepared) -> dict[str, Any]:
    rt = TorchrunRuntime(cfg, cfg.backend)
    try:
        return train(cfg, prep, rt)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
