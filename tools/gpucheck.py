"""Prove every GPU path in one command: `make gpu-check` (or `python tools/gpucheck.py`).

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
"""

from __future__ import annotations

import argparse
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

from tools import gpucheck_mfu

ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = 0.15
"""Predicted ÷ measured peak device memory must lie in [0.85, 1.15] (GPU runs only)."""
DEVICE_TOLERANCE = 0.10
"""GPU runs: the planner's device-level total must be at least the measured device-level
peak (NVML / mem_get_info: what an OOM sees) and at most 10% above it."""
FIT = 0.80
"""A strategy's model is shrunk (layers halved) until the planner predicts at most this
share of the GPU's memory."""

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": {"name": "ddp"}},
    "fsdp": {"strategy": {"name": "fsdp"}},
    "fsdp_ac": {"strategy": {"name": "fsdp", "activation_checkpointing": True}},
    # MFU where it means something: Raylift's step on a Llama-3-8B shape, as many layers
    # as fit (tools/gpucheck_mfu.py; no checkpoint or export). Before ZeRO-3, as above.
    "mfu_8b": {"strategy": {"name": "fsdp"}},
    # Adapters sharded: the frozen base split over the ranks (torchao NF4 under FSDP2).
    # Before ZeRO-3 runs: on CPU every job shares one process, and ZeRO-3's partitioned
    # init leaves torch's F.linear patched for the rest of it.
    "fsdp_lora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "lora"}},
    "fsdp_qlora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "qlora"}},
    "zero2": {"strategy": {"name": "deepspeed", "config": "zero2"}},
    "zero3": {"strategy": {"name": "deepspeed", "config": "zero3"}},
    "zero3_offload": {"strategy": {"name": "deepspeed", "config": "zero3_offload"}},
    "lora": {"strategy": {"name": "ddp"}, "model": {"adapter": "lora"}},
    "qlora": {
        "strategy": {"name": "ddp"},
        "model": {"adapter": "qlora"},
        "optim": {"name": "adamw8bit"},
    },
    "zero3_lora": {
        "strategy": {"name": "deepspeed", "config": "zero3"},
        "model": {"adapter": "lora"},
    },
}


def has_adapter(name: str) -> bool:
    return STRATEGIES[name].get("model", {}).get("adapter", "none") != "none"


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    block: int
    micro: int
    steps: int
    lr: float
    adapter_lr: float
    """Adapters train few weights and take a larger rate; 1e-2 diverged in bf16 on the
    0.3B GPU model (loss 6.8 -> 4.3 -> 18 in six steps on an H200) and 1e-3 fell to 3.2."""
    ffn: int = 0
    """The MLP's width (0: twice the hidden size)."""
    kv_heads: int = 0
    """Key/value heads (0: half the heads)."""
    vocab: int = 0
    """The model's vocabulary, at least the tokenizer's (0: the tokenizer's)."""

    @property
    def intermediate(self) -> int:
        return self.ffn or 2 * self.hidden


GPU_SIZE = Size(
    hidden=2048, layers=16, heads=16, block=512, micro=4, steps=10, lr=3e-4, adapter_lr=1e-3
)
"""About 0.6B parameters: 16 layers of 2048 wide (GQA, 8 KV heads, MLP 4096 wide)."""
CPU_SIZE = Size(hidden=64, layers=2, heads=4, block=32, micro=2, steps=4, lr=3e-3, adapter_lr=1e-2)


# ---------------------------------------------------------------- pure: configs and judging


def llama_config(size: Size, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": max(vocab, size.vocab),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads or max(1, size.heads // 2),
        "max_position_embeddings": max(256, size.block),
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def job_dict(
    name: str, size: Size, world: int, gpu: bool, assets: dict[str, str], storage: str
) -> dict[str, Any]:
    case = STRATEGIES[name]
    half = max(1, size.steps // 2)
    lr = size.adapter_lr if has_adapter(name) else size.lr
    return {
        "model": {
            "path": assets["model"],
            "special_tokens": assets["tokens"],
            **case.get("model", {}),
        },
        "data": {"train_file": assets["train"], "block_size": size.block},
        "strategy": case["strategy"],
        "train": {
            "micro_batch_size": size.micro,
            "max_steps": size.steps,
            "precision": "bf16" if gpu else "fp32",
            "log_every": 1,
            "seed": 7,
        },
        "optim": {"lr": lr, "schedule": "constant", **case.get("optim", {})},
        "scaling": {"num_workers": world, "use_gpu": gpu},
        "checkpoint": {"every_steps": half, "keep_last": 2},
        "storage": {"path": storage},
        "run": {"name": f"gpucheck-{name}"},
    }


def judge(result: dict[str, Any], gpu: bool) -> list[str]:
    """Why this job fails the check (empty: it passes)."""
    if result.get("kind") == "mfu" or result.get("strategy") == gpucheck_mfu.CASE:
        return gpucheck_mfu.judge(result, gpu)
    if result.get("error"):
        return [result["error"]]
    problems = []
    losses = result["losses"]
    k = max(1, len(losses) // 3)
    if not losses or sum(losses[-k:]) / k >= sum(losses[:k]) / k:
        problems.append(f"loss did not fall ({losses})")
    if result["resumed_from"] != result["stop_at"]:
        problems.append(
            f"did not resume from its step-{result['stop_at']} checkpoint "
            f"(resumed from {result['resumed_from']})"
        )
    if not result["export_ok"]:
        problems.append(f"export did not reload: {result['export_error']}")
    device = result.get("device_over_measured")
    ratio = result.get("predicted_over_measured")
    if gpu and device is not None:
        if not 1.0 <= device <= 1 + DEVICE_TOLERANCE:
            problems.append(
                f"planner's device-level total ÷ measured device peak = {device:.2f} is outside "
                f"[1.00, {1 + DEVICE_TOLERANCE:.2f}]"
            )
    elif gpu and (ratio is None or abs(ratio - 1) > TOLERANCE):
        problems.append(f"planner predicted ÷ measured = {ratio} is outside ±{TOLERANCE:.0%}")
    return problems


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def table(results: list[dict[str, Any]], gpu: bool) -> str:
    mem = "reserved/alloc MiB" if gpu else "peak RSS MiB"
    head = (
        f"{'gpus':>4} {'strategy':<14} {'params':>7} {'loss':>15} {'tokens/s':>9} {'MFU':>6} "
        f"{mem:>20} {'pred/meas':>9} {'÷bare':>6}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        losses = r.get("losses") or []
        loss = f"{losses[0]:.2f}→{losses[-1]:.2f}" if losses else "-"
        if gpu:
            m = f"{_mib(r.get('max_memory_reserved'))}/{_mib(r.get('max_memory_allocated'))}"
        else:
            m = _mib(r.get("peak_rss"))
        mfu = r.get("mfu")
        ratio = r.get("predicted_over_measured")
        bare = "-" if r.get("vs_bare") is None else f"{r['vs_bare']:.2f}"
        verdict = "PASS" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        lines.append(
            f"{r['world']:>4} {r['strategy']:<14} {r.get('params', 0) / 1e6:>6.1f}M {loss:>15} "
            f"{r.get('tokens_per_s') or 0:>9,.0f} {'-' if mfu is None else f'{mfu:.1%}':>6} "
            f"{m:>20} {'-' if ratio is None else f'{ratio:.2f}':>9} "
            f"{bare:>6}"
            f"{'' if gpu else ' (not judged)'}  {verdict}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, gpu: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\n×{r['world']}" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = ["tab:green" if not r["problems"] else "tab:red" for r in results]
    axes[0].bar(labels, [r.get("tokens_per_s") or 0 for r in results], color=colours)
    axes[0].set_title("tokens/s (all ranks)", fontsize=9)
    if gpu:
        axes[1].bar(labels, [100 * (r.get("mfu") or 0) for r in results], color=colours)
        axes[1].set_title("MFU %", fontsize=9)
    else:
        axes[1].bar(labels, [(r.get("peak_rss") or 0) / 2**20 for r in results], color=colours)
        axes[1].set_title("peak RSS MiB per rank (CPU; not judged)", fontsize=9)
    ratios = [r.get("predicted_over_measured") or 0 for r in results]
    axes[2].bar(labels, ratios, color=colours)
    for y in (1 - TOLERANCE, 1 + TOLERANCE):
        axes[2].axhline(y, color="k", linestyle="--", linewidth=0.8)
    axes[2].set_title(
        "planner predicted ÷ measured peak" + ("" if gpu else " (CPU: not judged)"), fontsize=9
    )
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    fig.suptitle("gpucheck: " + ("GPU" if gpu else "CPU self-check (GPU run still to be done)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- assets and runs


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


def fitted_size(name: str, size: Size, world: int, gpu_bytes: float | None) -> Size:
    """Halve the layers until the planner predicts this strategy fits FIT of the GPU."""
    if gpu_bytes is None:
        return size
    while size.layers > 1 and predicted(name, size, world) > FIT * gpu_bytes:
        size = replace(size, layers=size.layers // 2)
    return size


def case_size(
    name: str, base: Size, world: int, gpu_bytes: float | None, steps: int | None
) -> Size:
    """The model a case trains: the strategies' shared size fitted to the GPU, or for the
    MFU case the Llama-3-8B shape with the most layers the planner fits (tiny on CPU)."""
    if name != gpucheck_mfu.CASE:
        return fitted_size(name, base, world, gpu_bytes)
    big, tiny = gpucheck_mfu.sizes()
    size = tiny if gpu_bytes is None else gpucheck_mfu.most_layers(big, world, gpu_bytes)
    return replace(size, steps=steps) if steps else size


def _cfg(name: str, size: Size, world: int, gpu: bool, assets: dict[str, str], storage: str):
    from trainer.config import load_config

    return load_config(job_dict(name, size, world, gpu, assets, storage))


def _plan(cfg: Any, shape: Any) -> tuple[Any, Any]:
    from trainer.planner.memory import Setup, rank_memory

    setup = Setup.from_config(cfg)
    return setup, rank_memory(shape, setup)


def predicted(name: str, size: Size, world: int, vocab: int = 520) -> float:
    """Predicted peak GPU bytes per rank, without the CUDA context and library workspaces
    (which `max_memory_reserved` does not see either)."""
    from trainer.planner.shape import ModelShape

    fake = {"model": "/nonexistent", "train": "/nonexistent.jsonl", "tokens": "/nonexistent"}
    cfg = _cfg(name, size, world, True, fake, "/tmp")
    _, mem = _plan(cfg, ModelShape.from_hf_config(llama_config(size, vocab)))
    return mem.total - mem.overhead


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
            "mfu": self.name == gpucheck_mfu.CASE,
        }


def prepare(name: str, size: Size, world: int, gpu: bool, out: Path) -> Job:
    storage = out / "runs" / f"{world}x-{name}"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    tokens = size.steps * world * size.micro * size.block * 2
    assets = build_assets(out, size, tokens, bf16=gpu and name == gpucheck_mfu.CASE)
    data = job_dict(name, size, world, gpu, assets, str(storage))
    (storage / "job.yaml").write_text(yaml.safe_dump(data))
    return Job(name, size, world, gpu, storage, assets, out / "logs" / f"{world}x-{name}.log")


def run_jobs(jobs: list[Job], log: Path, timeout: float) -> tuple[int, float]:
    """One torchrun over `jobs` (all of the same world size); its exit code and seconds."""
    plan = log.with_suffix(".plan.json")
    plan.write_text(json.dumps([j.item() for j in jobs]))
    t0 = time.monotonic()
    worker = str(ROOT / "tools" / "gpucheck_worker.py")
    rc = torchrun([worker, str(plan)], jobs[0].world, log, timeout * len(jobs), jobs[0].gpu)
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
        return {**result, **gpucheck_mfu.row(job, cfg, ranks, peak)}
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
    setup, mem = _plan(cfg, shape)
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


def device_figures(shape: Any, setup: Any, device: str, ranks: list[dict]) -> dict[str, Any]:
    """The planner's device-level total on this GPU kind (the catalog's figures) against
    the measured device-level peak, and the parts the calibration is made from."""
    from trainer.planner.device import kind_of
    from trainer.planner.memory import rank_memory

    kind = kind_of(device)
    dev = rank_memory(shape, setup, kind, setup.world)
    peaks = [r.get("device_peak") or 0 for r in ranks]
    contexts = sorted(r["context_bytes"] for r in ranks if r.get("context_bytes"))
    out: dict[str, Any] = {
        "gpu_model": kind,
        "tensors": dev.tensors,
        "device_lines": dev.device,
        "device_predicted": dev.total,
        "device_peak": max(peaks) or None,
        "context_bytes": contexts[len(contexts) // 2] if contexts else None,
    }
    if out["device_peak"]:
        out["device_over_measured"] = dev.total / out["device_peak"]
    return out


def calibration_from(results: list[dict[str, Any]], meta: dict[str, str]) -> Any:
    """The calibration file's content from a GPU run's rows: the measured context (median
    over the jobs), and per strategy the allocator's slack as a share of the tensors (the
    measured device peak less the tensors, the context and the catalog's NCCL and cuBLAS
    lines, on one GPU), and the error of the calibrated model on the other GPU counts."""
    from trainer.planner.calibration import Calibration, StrategyCalibration
    from trainer.planner.device import MIB, catalog

    pool = catalog()["allocator"]["fixed_mib"] * MIB  # the slack line's small-block pool
    rows = [r for r in results if r.get("device_peak") and r.get("gpu_model")]
    if not rows:
        return None
    contexts = sorted(r["context_bytes"] for r in rows if r.get("context_bytes"))
    context = contexts[len(contexts) // 2] if contexts else None
    strategies: dict[str, StrategyCalibration] = {}
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["world"])
        base = mine[0]

        def fixed(r: dict[str, Any]) -> float:
            lines = r["device_lines"]
            ctx = context if context is not None else lines["cuda_context"]
            return ctx + lines["nccl_buffers"] + lines["cublas_workspaces"] + pool

        slack = max(0.0, (base["device_peak"] - base["tensors"] - fixed(base)) / base["tensors"])
        errors = [
            abs(r["tensors"] * (1 + slack) + fixed(r) - r["device_peak"]) / r["device_peak"]
            for r in mine[1:]
        ]
        strategies[name] = StrategyCalibration(
            slack_fraction=slack,
            expandable_segments=meta.get("expandable_segments", "true") == "true",
            predicted=base["device_predicted"],
            measured=base["device_peak"],
            error=max(errors) if errors else None,
        )
    return Calibration(
        gpu_name=meta.get("gpu_name", ""),
        gpu_model=rows[0]["gpu_model"],
        torch=meta.get("torch", ""),
        cuda=meta.get("cuda", ""),
        nccl=meta.get("nccl", ""),
        date=meta.get("date", ""),
        context_bytes=context,
        strategies=strategies,
    )


def run_meta(device: str) -> dict[str, str]:
    import datetime

    import torch

    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # a build without NCCL
        nccl = ""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return {
        "gpu_name": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "nccl": nccl,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        # The workers set expandable segments unless this environment set its own.
        "expandable_segments": "false"
        if conf and "expandable_segments:True" not in conf
        else "true",
    }


def write_report(
    out: Path, gpu: bool, device: str, gpus: int, results: list[dict[str, Any]], total: int
) -> dict[str, Any]:
    complete = len(results) == total
    report = {
        "gpu": gpu,
        "gpu_run_done": gpu and complete,
        "complete": complete,
        "device": device,
        "gpus": gpus,
        "tolerance": TOLERANCE,
        "results": results,
        "passed": complete and all(not r["problems"] for r in results),
    }
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / "report.json")
    return report


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
    if gpu:  # the loss kernels side by side, in a process of its own: tools/gpucheck_loss.py
        bench = [sys.executable, "-m", "tools.gpucheck_loss", "--out", str(args.out)]
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
            slow = gpu and any(j.name == gpucheck_mfu.CASE for j in batch)
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
            print(gpucheck_mfu.line(r))
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


if __name__ == "__main__":
    sys.exit(main())
