"""Sequence parallelism's memory, measured against the planner: one training step of a
16,384-token sequence (a Llama of hidden 256, 4 layers, 8 heads, 4 KV heads; fp32 on CPU,
sdpa, the chunked loss, no checkpointing), on one replica split over sp = 1, 2 and 4 gloo
ranks (tests/bench/sp_worker.py, the real DDP strategy with `strategy.sp`). Each rank's
peak resident memory above its own before the step (gradients already allocated by a
warm-up step) is its activations and the step's transients; the planner's prediction
beside it is trainer.planner.memory.activation_bytes with the same Setup (its share of
the tokens; without checkpointing, the all-to-all's buffers only where they exceed the
loss's). Target: within 10 % for each sp.

Sizes: RAYLIFT_BENCH_SP_TOKENS (the sequence), RAYLIFT_BENCH_REPEATS (rounds). Marked
bench_only (three multi-process runs): `make bench` runs it, CI does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.benchutil import ROOT, Check, run_benchmark, size

pytestmark = pytest.mark.bench_only

TOKENS = size("RAYLIFT_BENCH_SP_TOKENS", 16384, 512)
SPS = (1, 2, 4)
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc's mmap threshold pinned (it otherwise grows after large frees, up to 32 MiB): every
large tensor is mapped and unmapped, so the warm-up step's freed activations are not kept
in the heap, still resident, under the measured step's peak (measured: 74 MiB against
147 MiB at sp 2, 4096 tokens, without it)."""
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 65536,
}


def predicted(sp: int) -> float:
    from trainer.planner.memory import Setup, activation_bytes
    from trainer.planner.shape import ModelShape

    s = Setup(
        "ddp",
        gpu=False,
        precision="fp32",
        world=sp,
        block_size=TOKENS,
        attention="sdpa",
        loss="chunked",
        sp=sp,
    )
    return activation_bytes(ModelShape.from_hf_config(CONFIG), s, False)


def _case(sp: int, model_dir: Path):
    def run(_round: int) -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, "-m", "tests.bench.sp_worker", str(sp), str(TOKENS), str(model_dir)],
            cwd=ROOT,
            env={**os.environ, **FIXED_MMAP},
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        return {"peak_bytes": max(got["peak_bytes"]), "loss": got["loss"]}

    return run


def _gib(sp: int):
    return lambda r: r[f"sp{sp}"]["peak_bytes"] / 2**30


def _off(sp: int):
    return lambda r: abs(r[f"sp{sp}"]["peak_bytes"] / predicted(sp) - 1)


def test_bench_sp_peak_memory_per_rank(tmp_path: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    LlamaForCausalLM(LlamaConfig(**conf)).float().save_pretrained(str(tmp_path / "model"))
    commands = {f"sp{sp}": _case(sp, tmp_path / "model") for sp in SPS}
    checks = []
    for sp in SPS:
        checks += [
            Check(f"sp{sp}_peak_gib_per_rank", _gib(sp), unit="GiB"),
            Check(f"sp{sp}_planner_gib", lambda r, sp=sp: predicted(sp) / 2**30, unit="GiB"),
            Check(f"sp{sp}_off_the_plan", _off(sp), 0.10, higher_is_better=False, unit="×"),
        ]
    run_benchmark(
        "sp",
        title=f"Peak RSS per rank, one step of {TOKENS} tokens, sp 1 / 2 / 4 vs the planner",
        commands=commands,
        checks=checks,
        metric="peak_bytes",
        unit="bytes",
        setup={"tokens": TOKENS, "model": CONFIG, "sps": list(SPS)},
    )
