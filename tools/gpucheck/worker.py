"""gpucheck's jobs on this rank, run under torchrun by tools/gpucheck/jobs.py. Each job goes
through what `python -m trainer run` does under torchrun (trainer.runtime.launch: preflight, the
node checks, tokenizing on rank 0 first; then trainer.loop.train: the strategy, steps,
checkpoints, the export) twice in this process: first to `train.stop_at_step` (it
checkpoints there), then again to the end, which resumes from that checkpoint. Peak
memory is taken over the first part (a fresh start, what the planner predicts); each
rank writes it to the job's OUT/rank<N>.json. Several jobs in one torchrun share the
imports, the process start and one process group (torchrun's store cannot host a
second default group after the first is destroyed); on GPUs each job gets its own.

    torchrun --nproc_per_node N -m tools.gpucheck.worker PLAN_JSON
    (PLAN_JSON: [{"job": JOB_YAML, "stop_at": K, "out": OUT_DIR}, ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from tools.gpucheck.probes import RssGrowth, reset_peaks


def run_job(cfg) -> dict:
    """trainer.runtime.launch.run_job's torchrun branch, over the process group already up."""
    from trainer import preflight
    from trainer.checkpoint.manager import latest_export
    from trainer.loop import train
    from trainer.runtime import launch
    from trainer.runtime.worker import TorchrunRuntime, run_location

    report = preflight.run_all(cfg, strict=True)
    launch.check_nodes(cfg, report, torchrun=True)
    rank = int(os.environ.get("RANK", "0"))
    prep = launch._prepare_rank0_first(cfg, rank)
    last = train(cfg, prep, TorchrunRuntime(cfg, cfg.backend))
    if rank == 0:  # the job record `raylift report` plans again (planned against measured)
        launch._record_job(cfg, run_location(cfg))
    export = latest_export(run_location(cfg))
    return {"metrics": last, "export": export.uri if export is not None else None, "prep": prep}


def run(job: Path, stop_at: int, out: Path, name: str = "") -> None:
    import torch

    from trainer.config import load_config

    gpu = load_config(job, []).scaling.use_gpu
    rank = int(os.environ.get("RANK", "0"))
    reset_peaks(gpu)
    if gpu:
        from trainer.observability.device_memory import DeviceMemory

        # The device-level peak (what an OOM sees: context, NCCL, the allocator's whole
        # reservation), sampled through the first part; the allocator's own beside it.
        meter = DeviceMemory(torch.device("cuda", torch.cuda.current_device()), settle=True)
        with meter.phase("first_part"):
            first = run_job(load_config(job, [f"train.stop_at_step={stop_at}"]))
        row = meter.peaks["first_part"]
        mem = {
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "device_peak": row["device_peak"],
            "device_settled": row.get("device_settled"),
            "reserved_settled": row.get("reserved_settled"),
            "context_bytes": CONTEXT.get("bytes"),
            "device": torch.cuda.get_device_name(),
        }
    else:
        with RssGrowth() as growth:
            first = run_job(load_config(job, [f"train.stop_at_step={stop_at}"]))
        mem = {"peak_rss": growth.bytes, "device": "cpu"}
    # The same model, data and batch through the framework's own bare loop (tools/gpucheck/bare.py).
    from tools.gpucheck.bare import bare_tokens_per_s

    cfg = load_config(job, [])
    mem["bare_tokens_per_s"] = bare_tokens_per_s(cfg, first["prep"], name)
    reset_peaks(gpu)
    if gpu:
        summary, mem["syncs"], mem["sync_sites"] = _counting_syncs(load_config(job, []))
    else:
        summary = run_job(load_config(job, []))
    summary.pop("prep", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({**mem, "summary": summary}, default=str))


def _counting_syncs(cfg) -> tuple[dict, int, list[tuple[str, int]]]:
    """The second part (resume to the end) with torch.cuda.set_sync_debug_mode("warn"):
    every host-device synchronisation warns once per call site and step; their count and
    the five most frequent sites. It counts the whole part (checkpoint, export included),
    not only the steady steps."""
    import collections
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, _profiled(cfg):
            warnings.simplefilter("always")
            summary = run_job(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return summary, len(syncs), sites.most_common(5)


TRACE_LIMIT = 40 * 2**20
"""A gzipped trace larger than this is not kept (the lease brings back what fits)."""


@contextlib.contextmanager
def _profiled(cfg):
    """Rank 0's torch.profiler trace (CPU and CUDA activity) of the second part, gzipped
    beside the report: <out>/traces/<run name>.json.gz. A profiler that fails costs the
    job nothing."""
    import gzip
    import shutil

    import torch

    out = os.environ.get("GPUCHECK_TRACES")
    if not out or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    except Exception as exc:  # no CUPTI here: no trace
        print(f"gpucheck: no profiler trace ({exc})", flush=True)
        yield
        return
    try:
        yield
    finally:
        try:
            prof.__exit__(None, None, None)
            folder = Path(out)
            folder.mkdir(parents=True, exist_ok=True)
            raw = folder / f"{cfg.run.name}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            if Path(f"{raw}.gz").stat().st_size > TRACE_LIMIT:
                Path(f"{raw}.gz").unlink()
                print(f"gpucheck: trace of {cfg.run.name} over {TRACE_LIMIT >> 20} MiB: dropped")
        except Exception as exc:  # a trace is a report, never a failure
            print(f"gpucheck: trace of {cfg.run.name} not written ({exc})", flush=True)


CONTEXT: dict[str, int] = {}
"""The device bytes in use once CUDA and torch's kernels are up, before any tensor of a
job: the CUDA context line the calibration records."""


def _measure_context() -> None:
    import torch

    from trainer.observability.device_memory import DeviceMemory

    if not torch.cuda.is_available():
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    x = torch.ones(1, device="cuda")  # the context and the allocator's first segment
    (x @ x.view(1, 1)).sum().item()  # cuBLAS loaded
    del x
    torch.cuda.empty_cache()
    meter = DeviceMemory(torch.device("cuda", torch.cuda.current_device()))
    CONTEXT["bytes"] = meter.used() - torch.cuda.memory_reserved()


def main() -> None:
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.observability.logs import setup_logging
    from trainer.runtime.allocator import apply
    from trainer.runtime.worker import init_process_group

    setup_logging()
    items = json.loads(Path(sys.argv[1]).read_text())
    first = load_config(Path(items[0]["job"]), [])
    apply(first)  # expandable segments, as a GPU worker of a real job gets them
    _measure_context()
    init_process_group(first.backend)
    for item in items:
        if item.get("mfu"):  # Raylift's step at a Llama-3-8B shape (tools/gpucheck/mfu.py)
            from tools.gpucheck.mfu import run_rank

            run_rank(
                Path(item["job"]), Path(item["out"]), load_config(Path(item["job"])).train.max_steps
            )
            continue
        run(Path(item["job"]), int(item["stop_at"]), Path(item["out"]), item.get("name", ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
