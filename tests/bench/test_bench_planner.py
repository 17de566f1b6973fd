"""Planner accuracy: the planner's predicted memory per rank against the peak measured on
CPU, for a small Llama under a few strategies, adapters and activation settings.

Each case runs in a fresh process (one rank, CPU, fp32): it imports everything first,
warms the runtime up on a throwaway model, takes its resident set as the baseline,
resets the kernel's peak-RSS mark (/proc/self/clear_refs), builds the strategy from the
model folder, runs two optimizer steps (Adam state exists from the first), and reports
VmHWM − baseline, with large allocations given back to the kernel on free (see
measure()). The prediction
is the planner's per-rank total minus its stated framework overhead (the imports, which
are below the baseline). Target: every case within ±15%.

    make bench        (or: pytest tests/bench/test_bench_planner.py -s -o testpaths=tests/bench)

Sizes from the environment: RAYLIFT_BENCH_PLAN_HIDDEN (default 512) and
RAYLIFT_BENCH_PLAN_LAYERS (default 4). DeepSpeed is left out: on CPU it JIT-builds its
ops first, and ZeRO with one rank is DDP-shaped anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchutil import ROOT, Check, results_dir, run_benchmark, size, smoke

from tests.support.bench_inputs import VOCAB, make_model

# Minutes even at smoke size: make bench runs it, make test leaves it out (docs/development.md).
pytestmark = pytest.mark.bench_only

CASES: dict[str, dict[str, Any]] = {
    "ddp_b4_s256": {"strategy": {"name": "ddp"}, "micro": 4, "block": 256},
    "ddp_b4_s256_ckpt": {"strategy": {"name": "ddp"}, "micro": 4, "block": 256, "ckpt": True},
    "ddp_b8_s128": {"strategy": {"name": "ddp"}, "micro": 8, "block": 128},
    "fsdp_b4_s256": {"strategy": {"name": "fsdp"}, "micro": 4, "block": 256},
    "lora_b4_s256": {"strategy": {"name": "ddp"}, "micro": 4, "block": 256, "adapter": "lora"},
    "fsdp_lora_b4_s256": {
        "strategy": {"name": "fsdp"},
        "micro": 4,
        "block": 256,
        "adapter": "lora",
    },
    "fsdp_qlora_b4_s256": {
        "strategy": {"name": "fsdp"},
        "micro": 4,
        "block": 256,
        "adapter": "qlora",
    },
}


FAMILY_CASES: dict[str, dict[str, Any]] = {
    **{
        f"{fam}_b4_s256": {"strategy": {"name": "ddp"}, "micro": 4, "block": 256, "family": fam}
        for fam in ("qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
    },
    "gemma2_lora_b4_s256": {
        "strategy": {"name": "ddp"},
        "micro": 4,
        "block": 256,
        "adapter": "lora",
        "family": "gemma2",
    },
    "phi3_fsdp_lora_b4_s256": {
        "strategy": {"name": "fsdp"},
        "micro": 4,
        "block": 256,
        "adapter": "lora",
        "family": "phi3",
    },
}
"""Each family's own layout (fused qkv, four norms, soft-capping, eager attention, tied
embeddings; tests/support/families.py at the bench's sizes), planned from its config.json.
Full runs only: a smoke run keeps to the Llama cases."""


def family_model(out: Path, family: str, hidden: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM

    from tests.support.families import family_config

    if not (out / "config.json").exists():
        conf = family_config(family, VOCAB, hidden=hidden, layers=layers)
        AutoModelForCausalLM.from_config(conf).save_pretrained(out, safe_serialization=True)
    return out


def job(case: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "path": str(model_dir),
            "gradient_checkpointing": case.get("ckpt", False),
            "adapter": case.get("adapter", "none"),
        },
        "data": {"train_file": "unused.jsonl", "block_size": case["block"]},
        "strategy": case["strategy"],
        "train": {"micro_batch_size": case["micro"]},
        "scaling": {"num_workers": 1},
        "run": {"name": "bench-planner"},
    }


def predicted(cfg_dict: dict[str, Any]) -> float:
    from trainer.config import load_config
    from trainer.planner import plan, shape

    cfg = load_config(cfg_dict)
    p = plan.plan_job(cfg)
    return p.rank.total - shape.CPU_RANK_OVERHEAD


CHILD = r"""
import gc, json, sys
from pathlib import Path
import torch, transformers, peft, accelerate  # imported before the baseline
from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

cfg = load_config(json.loads(sys.argv[1]))
torch.manual_seed(0)
# Warm the runtime up (thread pools, allocator arenas, kernels) on a throwaway model of
# the same kind, so the baseline already holds what every run pays once per process.
warm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
    vocab_size=64))
xw = torch.randint(0, 64, (2, 16))
warm(input_ids=xw, labels=xw).loss.backward()
del warm, xw
gc.collect()
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
s = build_strategy(cfg, torch.device("cpu"), 0, 1)
s.setup(ModelSource(Path(cfg.model.path), int(sys.argv[2])))
s.model.train()  # as the loop does: checkpointing only acts in train mode
x = torch.randint(0, int(sys.argv[2]), (cfg.train.micro_batch_size, cfg.data.block_size))
for _ in range(2):
    with s.precision():
        loss = s.model(input_ids=x, labels=x).loss
    s.backward(loss)
    s.step()
print("PEAK", status("VmHWM:") - base)
"""


def measure(cfg_dict: dict[str, Any]) -> float:
    # Every allocation of 64 KiB or more gets its own mapping, returned to the kernel when
    # the tensor is freed: the resident set then follows the live tensors, as a GPU's
    # allocated-bytes counter does. (With glibc's defaults, freed activations stay in the
    # heap and the high-water mark grows with every step, whatever the model needs.)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg_dict), str(VOCAB)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("PEAK ")][-1]
    return float(line.split()[1])


def test_planner_accuracy():
    hidden = size("RAYLIFT_BENCH_PLAN_HIDDEN", 512, 64)
    layers = size("RAYLIFT_BENCH_PLAN_LAYERS", 4, 2)
    model_dir = make_model(results_dir() / f"planner_model_h{hidden}_l{layers}", hidden, layers)
    cases = {**CASES, **({} if smoke() else FAMILY_CASES)}
    picked = [c for c in os.environ.get("RAYLIFT_BENCH_PLAN_CASES", "").split(",") if c]
    cases = {k: v for k, v in cases.items() if not picked or k in picked}

    def folder(case: dict[str, Any]) -> Path:
        fam = case.get("family")
        if fam is None:
            return model_dir
        out = results_dir() / f"planner_{fam}_h{hidden}_l{layers}"
        return family_model(out, fam, hidden, layers)

    jobs = {name: job(case, folder(case)) for name, case in cases.items()}
    pred = {name: predicted(cfg) for name, cfg in jobs.items()}

    def command(name: str):
        def run(i: int) -> dict[str, float]:
            got = measure(jobs[name])
            return {"measured_mib": got / 2**20, "predicted_mib": pred[name] / 2**20}

        return run

    checks = [
        Check(
            f"{name}_error",
            lambda r, n=name: abs(r[n]["predicted_mib"] / r[n]["measured_mib"] - 1),
            0.15,
            higher_is_better=False,
        )
        for name in cases
    ]
    checks += [
        Check(f"{name}_ratio", lambda r, n=name: r[n]["predicted_mib"] / r[n]["measured_mib"])
        for name in cases
    ]
    run_benchmark(
        "planner",
        title="Planner: predicted / measured peak memory per rank (CPU, fp32)",
        commands={name: command(name) for name in cases},
        checks=checks,
        metric="measured_mib",
        unit="MiB",
        setup={"hidden": hidden, "layers": layers, "vocab": VOCAB, "cases": cases},
    )
