"""Prove every GPU path in one command: `make gpu-check` (or `python -m tools.gpucheck`).

For each GPU configuration of this machine (1 GPU, and all of them when there are several)
and each strategy (ddp, fsdp, fsdp + activation checkpointing, DeepSpeed ZeRO-2, ZeRO-3,
ZeRO-3 + CPU offload, LoRA, QLoRA), it trains a Llama built from a LlamaConfig (about
0.6B parameters in bf16, fewer layers where the planner says that strategy would not fit
the GPU) through the production entry under torchrun (`python -m trainer run`'s
`run_job`: preflight, tokenizing, the loop, checkpoints, the export). Each job stops at
half its steps with a checkpoint and resumes from it in the same process, then exports.

Judged per job: it finishes; the loss falls; it resumed from its checkpoint; the export
loads with plain transformers (and peft for adapters) and gives finite logits; on GPUs,
the planner's predicted peak device memory ÷ the measured `max_memory_reserved` is within
±15%. Reported: tokens/s, MFU (from the GPU's peak bf16 FLOP/s: trainer.planner.flops, or
--peak-tflops), peak memory per rank (reserved and allocated), predicted ÷ measured.
Writes build/gpucheck/report.json and report.png, prints a table, and exits 1 if anything
is judged failed.

Without CUDA it runs the same jobs in fp32 on CPU at tiny size on 2 gloo ranks (make test
runs it, so it cannot rot), judges everything but the memory ratio, and says that the GPU
run is still to be done.

This module is the driver: it sizes the cases, runs their jobs and writes the report;
the package's other modules each hold one part (tools/gpucheck/__init__.py lists them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.gpucheck import mfu
from tools.gpucheck.calibrate import calibration_from, run_meta
from tools.gpucheck.cases import CPU_SIZE, GPU_SIZE, STRATEGIES
from tools.gpucheck.jobs import ROOT, case_size, collect, prepare, run_jobs
from tools.gpucheck.report import judge, plot, table, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpucheck")
    p.add_argument("--only", nargs="*", choices=list(STRATEGIES), help="a subset of strategies")
    p.add_argument("--cpu", action="store_true", help="the CPU self-check even with CUDA")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's peak bf16 TFLOP/s (default: trainer.planner.flops)",
    )
    p.add_argument("--layers", type=int, help="decoder layers of the GPU model (default 16)")
    p.add_argument("--steps", type=int, help="steps per job (default 10 on GPU, 4 on CPU)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    args = p.parse_args(argv)

    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    n = torch.cuda.device_count() if gpu else 0
    base = GPU_SIZE if gpu else CPU_SIZE
    if args.layers:
        base = replace(base, layers=args.layers)
    if args.steps:
        base = replace(base, steps=args.steps)
    worlds = ([1, n] if n > 1 else [1]) if gpu else [2]
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if gpu else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    if gpu:  # the loss kernels side by side, in a process of its own: tools/gpucheck/loss.py
        bench = [sys.executable, "-m", "tools.gpucheck.loss", "--out", str(args.out)]
        try:
            subprocess.run(bench, timeout=240, check=False)
        except subprocess.TimeoutExpired:
            print("gpucheck: the loss kernels' bench ran past 240 s", flush=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    results: list[dict[str, Any]] = []
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    total = len(worlds) * len(args.only or STRATEGIES)
    for world in worlds:
        jobs = [
            prepare(name, case_size(name, base, world, gpu_bytes, args.steps), world, gpu, args.out)
            for name in args.only or list(STRATEGIES)
        ]
        # On GPUs each job gets its own processes (a crash or a fragmented allocator
        # stays with its job); the CPU self-check shares one start-up among all.
        batches = [[j] for j in jobs] if gpu else [jobs]
        for batch in batches:
            log = batch[0].log if len(batch) == 1 else args.out / "logs" / f"{world}x-all.log"
            names = ", ".join(j.name for j in batch)
            where = f"{world} GPU(s)" if gpu else f"{world} CPU ranks"
            print(f"gpucheck: {names} on {where} ...", flush=True)
            # The MFU case loads billions of weights: twice a job's time.
            slow = gpu and any(j.name == mfu.CASE for j in batch)
            rc, seconds = run_jobs(batch, log, args.timeout * (2 if slow else 1))
            for j in batch:
                r = collect(j, rc, log, peak)
                r["seconds"] = seconds
                r["problems"] = judge(r, gpu)
                results.append(r)
            # After every job: a run cut short (a lease ending, a hang past --timeout
            # on a later job) keeps what it measured, marked incomplete.
            report = write_report(args.out, gpu, device, n, results, total)
    plot(results, args.out / "report.png", gpu)
    if gpu:
        cal = calibration_from(results, run_meta(device))
        if cal is not None:
            print(f"calibration: {cal.write(args.out / 'calibration.json')}")
    print(table(results, gpu))
    for r in results:
        if r.get("kind") == "mfu":
            print(mfu.line(r))
    for r in results if gpu else []:
        if r.get("sync_sites") is not None:
            sites = ", ".join(f"{s} ×{n}" for s, n in r["sync_sites"])
            print(f"syncs: {r['strategy']}: {r['syncs_per_step']:.1f} per step ({sites})")
    print(f"report: {args.out / 'report.json'}, {args.out / 'report.png'}")
    if not gpu:
        print(
            "gpucheck: no CUDA device here: this was the CPU self-check (fp32, tiny model, 2 gloo "
            "ranks; memory ratios not judged). The GPU run is still to be done: run "
            "`make gpu-check` on a machine with CUDA GPUs."
        )
    return 0 if report["passed"] else 1
