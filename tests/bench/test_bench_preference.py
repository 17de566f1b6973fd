"""What one model in memory saves in DPO full fine-tuning: the peak resident memory of a
few DPO steps (AdamW, fp32) with the reference precomputed (Raylift: a column of
log-probs) against a live reference model (a second, frozen copy), side by side. Each
case runs in a process of its own, so each peak is its own.

Target: the saving (live's peak - precomputed's) is at least 0.9 of the reference's
weights (params × 4 bytes in fp32). Seconds per step are printed, not judged: the live
reference adds one forward per step, the precomputed one paid it once, before step 1.

Sizes: RAYLIFT_BENCH_PREF_HIDDEN, RAYLIFT_BENCH_PREF_LAYERS, RAYLIFT_BENCH_REPEATS."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.benchutil import ROOT, Check, run_benchmark, size, smoke

HIDDEN = size("RAYLIFT_BENCH_PREF_HIDDEN", 512, 32)
LAYERS = size("RAYLIFT_BENCH_PREF_LAYERS", 4, 2)
VOCAB = 500 if smoke() else 32000
PAIRS, BLOCK, STEPS = (2, 16, 2) if smoke() else (2, 64, 2)


def _case(mode: str):
    def run(_round: int) -> dict[str, float]:
        args = [mode, *map(str, (HIDDEN, LAYERS, VOCAB, PAIRS, BLOCK, STEPS))]
        out = subprocess.run(
            [sys.executable, "-m", "tests.bench.preference_worker", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


def _saved(r) -> float:
    return (r["live"]["peak_bytes"] - r["precomputed"]["peak_bytes"]) / r["live"]["weight_bytes"]


def test_bench_precomputed_reference_peak_memory():
    run_benchmark(
        "preference_reference",
        title=f"DPO peak RSS: precomputed vs live reference (hidden {HIDDEN}, {LAYERS} layers, "
        f"vocab {VOCAB})",
        commands={"precomputed": _case("precomputed"), "live": _case("live")},
        checks=[
            Check("saved_over_reference_weights", _saved, 0.9, unit="×"),
            Check(
                "precomputed_peak_gib", lambda r: r["precomputed"]["peak_bytes"] / 2**30, unit="GiB"
            ),
            Check("live_peak_gib", lambda r: r["live"]["peak_bytes"] / 2**30, unit="GiB"),
            Check(
                "live_over_precomputed_seconds",
                lambda r: r["live"]["seconds_per_step"] / r["precomputed"]["seconds_per_step"],
                unit="×",
            ),
        ],
        metric="peak_bytes",
        unit="bytes",
        setup={
            "hidden": HIDDEN,
            "layers": LAYERS,
            "vocab": VOCAB,
            "pairs": PAIRS,
            "block": BLOCK,
            "steps": STEPS,
        },
    )
