"""gpu-check's MFU case (issue 47): Raylift's training step on a Llama-3-8B-shaped model
(hidden 4096, 32 heads, 8 KV heads, MLP 14,336 wide, vocabulary 128,256) with as many of
its 32 layers as the planner fits on the GPU, FSDP2, bf16. At 0.6B parameters the step
is too small to keep an H200 busy, so the other cases' MFU says little about the step.

Only the step is measured: the strategy's model and optimizer, then for each step the
loop's own batch, loss divisor, forward/backward and optimizer step
(trainer.loop._targets_per_rank, _forward_backward, Strategy.step), timed over the steps
after the first with the device synchronised at both ends. No checkpoint or export: at
this size a checkpoint is tens of GB of disk and minutes of a short lease.

On CPU the same path runs at a tiny shape (one layer, hidden 64, vocabulary 32,000) so
`make test`'s self-check keeps it working; its MFU is not computed there.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.gpucheck.cases import FIT, Size, plan_memory, predicted
from tools.gpucheck.probes import RssGrowth, reset_peaks

CASE = "mfu_8b"
LAYERS_8B = 32


def sizes() -> tuple[Any, Any]:
    """(the GPU size, the CPU size) of the case."""
    gpu = Size(
        hidden=4096,
        layers=LAYERS_8B,
        heads=32,
        block=2048,
        micro=2,
        steps=6,
        lr=3e-4,
        adapter_lr=1e-3,
        ffn=14336,
        kv_heads=8,
        vocab=128256,
    )
    # CPU: the path, cheaply (make test runs it): one layer of 64, Llama-2's vocabulary
    # (128,256 cost the self-check three times a strategy's job on the shared 2-core VM).
    cpu = replace(
        gpu, hidden=64, layers=1, heads=4, kv_heads=1, ffn=224, block=32, steps=4, vocab=32000
    )
    return gpu, replace(cpu, lr=3e-3)


def most_layers(size: Any, world: int, gpu_bytes: float) -> Any:
    """`size` with the most layers (up to its own) that the planner fits in gpucheck's
    share of the GPU (gpucheck.FIT); one layer if none fits."""
    for layers in range(size.layers, 0, -1):
        candidate = replace(size, layers=layers)
        if predicted(CASE, candidate, world, size.vocab) <= FIT * gpu_bytes:
            return candidate
    return replace(size, layers=1)


def _wait(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_tokens_per_s(cfg: Any, prep: Any, steps: int) -> dict[str, Any]:
    """Raylift's step `steps` times on every rank (collective); tokens/s of all ranks over
    the steps after the first, and each step's loss (the mean over the global batch)."""
    import torch
    import torch.distributed as dist

    from trainer.distributed.hostsync import HostReduce, read_floats
    from trainer.loop import _forward_backward, _targets_per_rank, seed_all
    from trainer.model.loading import (
        check_device,
        load_tokenizer,
        local_model_dir,
        local_tokenizer_dir,
    )
    from trainer.strategies.base import ModelSource, build_strategy

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = check_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    seed_all(cfg.train.seed)
    tokenizer = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    strategy = build_strategy(cfg, device, rank, world)
    strategy.setup(ModelSource(local_model_dir(cfg), len(tokenizer)))
    objective = strategy.objective
    feed = objective.open_feed(prep.train_caches, prep.eval_caches, rank, world)
    reduce = HostReduce(device, world)
    strategy.model.train()
    losses: list[Any] = []
    started = time.perf_counter()
    for step in range(max(2, steps)):
        if step == 1:  # the first step (allocations, autotuning) is not timed
            _wait(device)
            started = time.perf_counter()
        micro = feed.micro_batches(step)
        per_rank, _ = _targets_per_rank(micro, device, world, [], objective.count, reduce)
        losses.append(_forward_backward(strategy, micro, per_rank, cfg, device))
        strategy.step()
    _wait(device)
    seconds = time.perf_counter() - started
    timed = len(losses) - 1
    summed = reduce([float(x) for x in read_floats(*losses)])
    params = strategy.param_count()
    del strategy, feed, objective
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": cfg.tokens_per_step * timed / seconds,
        "losses": [x / world for x in summed],
        "steps_timed": timed,
        "step_seconds": seconds / timed,
        "model_params": params,
    }


def row(job: Any, cfg: Any, ranks: list[dict[str, Any]], peak: float | None) -> dict[str, Any]:
    """The case's result row (tools/gpucheck/jobs.py collect's, for this case)."""
    from trainer.planner.plan import flops_per_token
    from trainer.planner.shape import shape_for_job

    first = ranks[0]
    shape = shape_for_job(cfg)
    setup, mem = plan_memory(cfg, shape)
    out: dict[str, Any] = {
        "kind": "mfu",
        "layers": job.size.layers,
        "layers_of": LAYERS_8B,
        "losses": first["losses"],
        "tokens_per_s": first["tokens_per_s"],
        "step_seconds": first["step_seconds"],
        "params": shape.params,
        "predicted": mem.total - mem.overhead,
        "mfu": None,
    }
    if job.gpu:
        from trainer.planner.flops import peak_flops

        out["device"] = first.get("device")
        out["max_memory_reserved"] = max(r["max_memory_reserved"] for r in ranks)
        out["max_memory_allocated"] = max(r["max_memory_allocated"] for r in ranks)
        out["predicted_over_measured"] = out["predicted"] / out["max_memory_reserved"]
        peak = peak or peak_flops(out["device"], "bf16")
        out["peak_flops"] = peak
        per_device = out["tokens_per_s"] / job.world
        out["mfu"] = flops_per_token(shape, setup) * per_device / peak if peak else None
    else:
        out["per_rank"] = [{"peak_rss": r["peak_rss"]} for r in ranks]
        out["peak_rss"] = max(r["peak_rss"] for r in ranks)
    return out


def judge(result: dict[str, Any], gpu: bool) -> list[str]:
    """Why the case fails (empty: it passes): it ran every step, its losses are finite,
    and on GPUs it has an MFU."""
    if result.get("error"):
        return [result["error"]]
    problems = []
    losses = result.get("losses") or []
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"losses not finite ({losses})")
    if not result.get("tokens_per_s"):
        problems.append("no tokens/s measured")
    if gpu and result.get("mfu") is None:
        problems.append(f"no MFU: no peak FLOP/s known for {result.get('device')} (--peak-tflops)")
    return problems


def line(result: dict[str, Any]) -> str:
    """The printed summary."""
    mfu = result.get("mfu")
    return (
        f"MFU at Llama-3-8B shape ({result['layers']} of {result['layers_of']} layers, "
        f"{result['params'] / 1e9:.2f}B params, {result['world']} "
        f"{'GPU(s)' if result.get('device') else 'CPU ranks'}): "
        f"{'n/a' if mfu is None else f'{mfu:.1%}'} at {result['tokens_per_s']:,.0f} tokens/s, "
        f"{result['step_seconds']:.3f} s per step"
    )


def run_rank(job: Path, out: Path, steps: int) -> None:
    """The case on this rank under gpucheck's torchrun: tokenizing (rank 0 first), the
    timed steps, this rank's figures to OUT/rank<N>.json."""
    import json

    import torch

    from trainer.config import load_config
    from trainer.runtime import launch

    cfg = load_config(job, [])
    rank = int(os.environ.get("RANK", "0"))
    prep = launch._prepare_rank0_first(cfg, rank)
    gpu = cfg.scaling.use_gpu
    if gpu:
        reset_peaks(gpu)
        got = step_tokens_per_s(cfg, prep, steps)
        got["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        got["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        got["device"] = torch.cuda.get_device_name()
    else:
        with RssGrowth() as growth:
            got = step_tokens_per_s(cfg, prep, steps)
        got["peak_rss"] = growth.bytes
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"kind": "mfu", **got}))
