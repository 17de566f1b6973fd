"""What the chunked linear cross-entropy saves: the peak resident memory of one causal-LM
loss + backward over 8 × 512 tokens (hidden 512), the plain way (every token's logits in
fp32, as Hugging Face computes them) against trainer.objectives.linear_ce's chunked loss
(1024 tokens at a time), at vocab 32,000 (Llama 2) and 128,256 (Llama 3). Each case runs
in a process of its own, so each peak is its own (RSS above the inputs).

Target, per vocab: the saving (plain's peak - chunked's) is at least 0.9 of the fp32
logits and their gradient, 2 · tokens · vocab · 4 bytes (at 128,256: 4.2 GB). The speed
ratio (chunked's seconds ÷ plain's) is printed, not judged: on CPU both run the same
matmuls; the chunked loss adds no recomputation.

Sizes: RAYLIFT_BENCH_LCE_TOKENS, RAYLIFT_BENCH_REPEATS (rounds)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.benchutil import ROOT, Check, run_benchmark, size, smoke

TOKENS = size("RAYLIFT_BENCH_LCE_TOKENS", 8 * 512, 64)
HIDDEN = 32 if smoke() else 512
VOCABS = (500, 2000) if smoke() else (32000, 128256)
CHUNK = 16 if smoke() else 1024


def _case(mode: str, vocab: int):
    def run(_round: int) -> dict[str, float]:
        args = [mode, str(vocab), str(HIDDEN), str(TOKENS), str(CHUNK)]
        out = subprocess.run(
            [sys.executable, "-m", "tests.bench.linear_ce_worker", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


def logits_and_grad_bytes(vocab: int) -> float:
    return 2.0 * TOKENS * vocab * 4


def _saved_share(vocab: int):
    def figure(r) -> float:
        saved = r[f"plain_{vocab}"]["peak_bytes"] - r[f"chunked_{vocab}"]["peak_bytes"]
        return saved / logits_and_grad_bytes(vocab)

    return figure


def _speed(vocab: int):
    return lambda r: r[f"chunked_{vocab}"]["seconds"] / r[f"plain_{vocab}"]["seconds"]


def _gib(mode: str, vocab: int):
    return lambda r: r[f"{mode}_{vocab}"]["peak_bytes"] / 2**30


def test_bench_linear_ce_peak_memory():
    commands = {}
    for vocab in VOCABS:
        commands[f"plain_{vocab}"] = _case("plain", vocab)
        commands[f"chunked_{vocab}"] = _case("chunked", vocab)
    checks = []
    for v in VOCABS:
        checks += [
            Check(f"saved_over_fp32_logits_and_grad_{v}", _saved_share(v), 0.9, unit="×"),
            Check(f"plain_peak_gib_{v}", _gib("plain", v), unit="GiB"),
            Check(f"chunked_peak_gib_{v}", _gib("chunked", v), unit="GiB"),
            Check(f"chunked_over_plain_seconds_{v}", _speed(v), unit="×"),
        ]
    run_benchmark(
        "linear_ce",
        title=f"Loss + backward peak RSS, plain vs chunked ({TOKENS} tokens, hidden {HIDDEN})",
        commands=commands,
        checks=checks,
        metric="peak_bytes",
        unit="bytes",
        setup={
            "tokens": TOKENS,
            "hidden": HIDDEN,
            "vocabs": list(VOCABS),
            "chunk": CHUNK,
            "fp32_logits_and_grad_bytes": {str(v): logits_and_grad_bytes(v) for v in VOCABS},
        },
    )
