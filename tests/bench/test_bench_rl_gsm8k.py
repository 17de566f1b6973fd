"""GSM8K-shaped accuracy run (issue 55's "It learns", second run): a 2-worker SFT job on
the question → answer text, then a 2-worker GRPO job from the SFT run's export with the
built-in `math_answer` reward (options {column: answer}), both submitted to the local
three-node Ray cluster the way `raylift run` submits (tests/support/ray_jobs.py).

The data is tools.demo.gsm8k's: "What is 3 plus 4?" with the answer "3 plus 4 is 7.\\n####
7", numbers 1..RAYLIFT_BENCH_GSM8K_MAX. The tiny Llama (tools.tiny: its tokenizer, random
weights) learns the format and part of the sums from the SFT job; GRPO then samples
num_generations completions of each prompt and moves toward the right sums.

Accuracy is each GRPO step's mean `math_answer` reward (the share of its completions
whose final answer is the sum), printed as a curve and drawn in
build/bench/rl_gsm8k_curve.png. Target: the final accuracy (mean of the last 3 steps)
above the first step's (gain ≥ 0.01); beside it, the mean of the last tenth of the
steps against the first tenth's (no target; one step's accuracy is noisy). One round:
the curve is the measurement.

Sizes: RAYLIFT_BENCH_GSM8K_SFT_STEPS, RAYLIFT_BENCH_GSM8K_STEPS (GRPO),
RAYLIFT_BENCH_GSM8K_PROMPTS (per worker and step), RAYLIFT_BENCH_GSM8K_MAX. Two Ray jobs
take minutes even at smoke size: bench_only, `make bench` runs it, `make test` does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.bench.benchutil import Check, results_dir, run_benchmark, size
from tests.support.ray_jobs import history, run_to_end

pytestmark = pytest.mark.bench_only

SFT_STEPS = size("RAYLIFT_BENCH_GSM8K_SFT_STEPS", 300, 10)
STEPS = size("RAYLIFT_BENCH_GSM8K_STEPS", 60, 4, minimum=4)
PROMPTS = size("RAYLIFT_BENCH_GSM8K_PROMPTS", 4, 1)
LARGEST = size("RAYLIFT_BENCH_GSM8K_MAX", 9, 9, minimum=2)
G, LENGTH, LR = 8, 20, 3e-4


def _write(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


def _jobs(root: Path, model: Path, data: dict[str, Path], i: int) -> tuple[Path, dict[str, Any]]:
    common = {
        "scaling": {"num_workers": 2},
        "storage": {"path": str(root / "runs")},
    }
    sft = {
        "model": {"path": str(model)},
        "data": {"train_file": str(data["sft"]), "block_size": 32},
        "train": {"micro_batch_size": 8, "max_steps": SFT_STEPS, "log_every": 10, "seed": i},
        "optim": {"lr": 3e-3, "warmup_steps": min(10, SFT_STEPS // 4)},
        "checkpoint": {"every_steps": SFT_STEPS, "keep_last": 1, "memory_every": 0},
        "run": {"name": f"gsm8k-sft-{i}"},
        **common,
    }
    grpo = {
        "data": {
            "train_file": str(data["prompts"]),
            "columns": {"prompt": "question"},
            "block_size": 64,
        },
        "train": {
            "objective": "grpo",
            "micro_batch_size": PROMPTS * G,
            "max_steps": STEPS,
            "log_every": 1,
            "seed": i,
            "rl": {
                "num_generations": G,
                "max_completion_length": LENGTH,
                "rewards": [{"function": "math_answer", "options": {"column": "answer"}}],
            },
        },
        "optim": {"lr": LR, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": STEPS, "keep_last": 1, "memory_every": 0},
        "run": {"name": f"gsm8k-grpo-{i}"},
        **common,
    }
    return _write(root / f"gsm8k-sft-{i}.yaml", sft), grpo


def _curve_png(curve: list[float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(range(1, len(curve) + 1), curve, "o-", color="tab:blue")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("accuracy (mean math_answer)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"GSM8K-shaped sums, tiny Llama after {SFT_STEPS} SFT steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def test_bench_grpo_accuracy_on_gsm8k_shaped_sums(ray_cluster, tmp_path: Path):
    from tools.demo import gsm8k
    from tools.tiny import build_all

    tiny = build_all(tmp_path / "tiny", rows=100, eval_rows=50)
    data = gsm8k.write(tmp_path / "gsm8k", 4000, LARGEST)
    setup: dict[str, Any] = {
        "sft_steps": SFT_STEPS,
        "steps": STEPS,
        "prompts": PROMPTS,
        "largest": LARGEST,
        "lr": LR,
    }

    def once(i: int) -> dict[str, float]:
        sft_path, grpo = _jobs(tmp_path, tiny["model"], data, i)
        _, summary, _ = run_to_end(ray_cluster, sft_path)
        grpo["model"] = {"path": f"{summary['export']}/model"}
        cfg, _, _ = run_to_end(ray_cluster, _write(tmp_path / f"gsm8k-grpo-{i}.yaml", grpo))
        _, kept, _ = history(cfg)
        curve = [r["rewards/math_answer/mean"] for r in kept if "rewards/math_answer/mean" in r]
        assert len(curve) == STEPS, curve
        setup["curve"] = [round(a, 4) for a in curve]  # build/bench/rl_gsm8k.json keeps it
        print("gsm8k accuracy per GRPO step: " + " ".join(f"{a:.3f}" for a in curve))
        # drawn before the verdict: a MISS raises, and its curve is the evidence
        results_dir().mkdir(parents=True, exist_ok=True)
        print(f"→ {_curve_png(curve, results_dir() / 'rl_gsm8k_curve.png')}")
        tenth = max(1, len(curve) // 10)
        return {
            "first": curve[0],
            "final": sum(curve[-3:]) / 3,
            "first_tenth": sum(curve[:tenth]) / tenth,
            "last_tenth": sum(curve[-tenth:]) / tenth,
        }

    result = run_benchmark(
        "rl_gsm8k",
        title=f"GRPO accuracy on GSM8K-shaped sums (tiny Llama, {SFT_STEPS} SFT steps, "
        f"{STEPS} GRPO steps, 2 workers × {PROMPTS} prompts × {G} generations)",
        commands={"gsm8k": once},
        checks=[
            Check("first_accuracy", lambda r: r["gsm8k"]["first"]),
            Check("final_accuracy", lambda r: r["gsm8k"]["final"]),
            Check("accuracy_gain", lambda r: r["gsm8k"]["final"] - r["gsm8k"]["first"], 0.01),
            # less noisy than one step against three (no target: the is the above)
            Check(
                "tenth_gain",
                lambda r: r["gsm8k"]["last_tenth"] - r["gsm8k"]["first_tenth"],
            ),
        ],
        metric="final",
        setup=setup,
        rounds=1,
    )
    assert result["commands"]["gsm8k"]["first"]["n"] == 1
