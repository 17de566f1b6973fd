"""gpu-check's jobs: the assets a case trains on (tokenizer, data, a random Llama), the
job folder, one torchrun over a batch of jobs (tools/gpucheck/worker.py on every rank),
and the result row read back from what each job left (rank files, metrics, the export).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from tools.gpucheck import mfu
from tools.gpucheck.calibrate import device_figures
from tools.gpucheck.cases import (
    Size,
    fitted_size,
    has_adapter,
    job_dict,
    llama_config,
    plan_memory,
)

ROOT = Path(__file__).resolve().parents[2]


def build_assets(out: Path, size: Size, tokens_needed: int, bf16: bool = False) -> dict[str, str]:
    """Tokenizer, data and special tokens (shared), and a random Llama of `size` (saved in
    bf16 with `bf16`: half the bytes to write and read for the 8B-shaped model)."""
    from tools.tiny import qa_pair, train_tokenizer, write_dataset, write_special_tokens

    shared = out / "assets"
    tok_dir = shared / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        import random

        rng = random.Random(1)
        train_tokenizer(tok_dir, [" ".join(qa_pair(rng)) for _ in range(2000)])
    rows = max(2000, tokens_needed // 20)
    data = shared / f"train-{rows}.jsonl"
    if not data.exists():
        write_dataset(data, rows, seed=0)
    tokens = write_special_tokens(shared / "tokens.json")
    shape = f"-f{size.ffn}-k{size.kv_heads}-v{size.vocab}" if size.vocab else ""
    model_dir = shared / f"llama-h{size.hidden}-l{size.layers}{shape}"
    if not (model_dir / "model.safetensors").exists() and not list(model_dir.glob("*.safetensors")):
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        vocab = len(AutoTokenizer.from_pretrained(str(tok_dir)))
        torch.manual_seed(0)
        conf = LlamaConfig(**llama_config(size, vocab))
        if bf16:  # billions of weights: drawn on the GPU (seconds, not minutes), saved from host
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # any transformers version's way
            try:
                with torch.device("cuda"):
                    model = LlamaForCausalLM(conf)
            finally:
                torch.set_default_dtype(default)
            model.to("cpu")
            torch.cuda.empty_cache()
        else:
            model = LlamaForCausalLM(conf)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        for f in tok_dir.iterdir():
            shutil.copy(f, model_dir / f.name)
        del model
    return {"model": str(model_dir), "train": str(data), "tokens": str(tokens)}


def case_size(
    name: str, base: Size, world: int, gpu_bytes: float | None, steps: int | None
) -> Size:
    """The model a case trains: the strategies' shared size fitted to the GPU, or for the
    MFU case the Llama-3-8B shape with the most layers the planner fits (tiny on CPU)."""
    if name != mfu.CASE:
        return fitted_size(name, base, world, gpu_bytes)
    big, tiny = mfu.sizes()
    size = tiny if gpu_bytes is None else mfu.most_layers(big, world, gpu_bytes)
    return replace(size, steps=steps) if steps else size


def torchrun(args: list[str], world: int, log: Path, timeout: float, gpu: bool) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    if not gpu:
        env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    else:  # rank 0's profiler trace of each job's second part, beside the report
        env.setdefault("GPUCHECK_TRACES", str(log.parent.parent / "traces"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        *args,
    ]
    with open(log, "w") as f:
        try:
            return subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ngpucheck: timed out after {timeout:.0f} s\n")
            return 124


def reload_export(export: Path, base: Path, adapter: bool, probe: list[list[int]]) -> None:
    """What a user does with the export, on CPU: plain transformers (and peft)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if adapter:
        from peft import PeftModel

        tok = AutoTokenizer.from_pretrained(export / "adapter")
        model = AutoModelForCausalLM.from_pretrained(base)
        model.resize_token_embeddings(len(tok))
        model = PeftModel.from_pretrained(model, export / "adapter")
    else:
        model = AutoModelForCausalLM.from_pretrained(export / "model")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(probe)).logits
    if not torch.isfinite(logits).all():
        raise ValueError("logits are not finite")


@dataclass
class Job:
    name: str
    size: Size
    world: int
    gpu: bool
    storage: Path
    assets: dict[str, str]
    log: Path

    @property
    def stop_at(self) -> int:
        return max(1, self.size.steps // 2)

    @property
    def ranks_dir(self) -> Path:
        return self.storage / "ranks"

    def item(self) -> dict[str, Any]:
        return {
            "job": str(self.storage / "job.yaml"),
            "stop_at": self.stop_at,
            "out": str(self.ranks_dir),
            "name": self.name,
            "mfu": self.name == mfu.CASE,
        }


def prepare(name: str, size: Size, world: int, gpu: bool, out: Path) -> Job:
    storage = out / "runs" / f"{world}x-{name}"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    tokens = size.steps * world * size.micro * size.block * 2
    assets = build_assets(out, size, tokens, bf16=gpu and name == mfu.CASE)
    data = job_dict(name, size, world, gpu, assets, str(storage))
    (storage / "job.yaml").write_text(yaml.safe_dump(data))
    return Job(name, size, world, gpu, storage, assets, out / "logs" / f"{world}x-{name}.log")


def run_jobs(jobs: list[Job], log: Path, timeout: float) -> tuple[int, float]:
    """One torchrun over `jobs` (all of the same world size); its exit code and seconds."""
    plan = log.with_suffix(".plan.json")
    plan.write_text(json.dumps([j.item() for j in jobs]))
    t0 = time.monotonic()
    worker = ["-m", "tools.gpucheck.worker", str(plan)]
    rc = torchrun(worker, jobs[0].world, log, timeout * len(jobs), jobs[0].gpu)
    return rc, round(time.monotonic() - t0, 1)


def collect(job: Job, rc: int, log: Path, peak: float | None) -> dict[str, Any]:
    """Read what the job left (rank files, metrics, export) into its result row."""
    from trainer.config import load_config
    from trainer.observability.metrics import lineage, read_records
    from trainer.planner.plan import flops_per_token
    from trainer.planner.shape import shape_for_job
    from trainer.storage.location import resolve

    name, world, gpu = job.name, job.world, job.gpu
    result: dict[str, Any] = {
        "strategy": name,
        "world": world,
        "size": asdict(job.size),
        "stop_at": job.stop_at,
        "log": str(log),
    }
    files = [job.ranks_dir / f"rank{r}.json" for r in range(world)]
    if not all(f.exists() for f in files):
        tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        result["error"] = f"job did not finish (torchrun exit {rc}): " + " | ".join(tail)[-400:]
        return result
    ranks = [json.loads(f.read_text()) for f in files]
    cfg = load_config(job.storage / "job.yaml")
    if ranks[0].get("kind") == "mfu":
        return {**result, **mfu.row(job, cfg, ranks, peak)}
    run = resolve(str(job.storage)).join(cfg.run.name)
    records = read_records(run.join("metrics.jsonl"))
    steps, _ = lineage(records)
    resumes = [r["from_step"] for r in records if r.get("event") == "resume"]
    result["losses"] = [r["loss"] for r in steps]
    result["resumed_from"] = resumes[-1] if resumes else None
    # Throughput of the steady steps: not the first step of either part (start-up).
    timed = [r["tokens_per_s"] for r in steps if r["step"] not in (1, job.stop_at + 1)]
    timed = timed or [r["tokens_per_s"] for r in steps]
    result["tokens_per_s"] = sorted(timed)[len(timed) // 2]
    bare = ranks[0].get("bare_tokens_per_s")
    result["bare_tokens_per_s"] = bare
    result["vs_bare"] = result["tokens_per_s"] / bare if bare else None
    shape = shape_for_job(cfg)
    setup, mem = plan_memory(cfg, shape)
    result["params"] = shape.params
    if gpu:
        from trainer.planner.flops import peak_flops

        device = ranks[0].get("device")
        result["device"] = device
        result["per_rank"] = [
            {k: r[k] for k in ("max_memory_reserved", "max_memory_allocated")} for r in ranks
        ]
        result["max_memory_reserved"] = max(r["max_memory_reserved"] for r in ranks)
        result["max_memory_allocated"] = max(r["max_memory_allocated"] for r in ranks)
        result["predicted"] = mem.total - mem.overhead
        result["predicted_over_measured"] = result["predicted"] / result["max_memory_reserved"]
        result.update(device_figures(shape, setup, device, ranks))
        steps_after = max(1, job.size.steps - job.stop_at)
        result["syncs_per_step"] = ranks[0].get("syncs", 0) / steps_after
        result["sync_sites"] = ranks[0].get("sync_sites")
        peak = peak or peak_flops(device, "bf16")
        result["peak_flops"] = peak
        per_device = result["tokens_per_s"] / world
        result["mfu"] = flops_per_token(shape, setup) * per_device / peak if peak else None
    else:
        result["per_rank"] = [{"peak_rss": r["peak_rss"]} for r in ranks]
        result["peak_rss"] = max(r["peak_rss"] for r in ranks)
        # Like for like with the GPU figure: the planner's state and activations, less
        # its per-process allowance, against RSS growth above the process's baseline.
        result["predicted"] = mem.total - mem.overhead
        result["predicted_over_measured"] = result["predicted"] / max(1, result["peak_rss"])
        result["mfu"] = None
    export = Path(ranks[0]["summary"]["export"])
    probe = json.loads((job.storage / cfg.run.name / "final_probe.json").read_text())
    try:
        adapter = has_adapter(name)
        reload_export(export, Path(job.assets["model"]), adapter, probe["input_ids"])
        result["export_ok"], result["export_error"] = True, None
    except Exception as exc:  # reported, and judged a failure
        result["export_ok"], result["export_error"] = False, f"{type(exc).__name__}: {exc}"
    return result
