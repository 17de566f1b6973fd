"""GRPO step time: Raylift's objective and `generate` rollout against TRL's GRPOTrainer,
on the same tiny Llama (tools.tiny), the same prompts, batch, num_generations, completion
length, learning rate and reward, one CPU process each, side by side in one run.

Raylift's step is split into its phases as its metrics report them: sampling
(rollout/generate_s), scoring (rollout/reward_s), the kept log-probs (none here: beta 0,
num_iterations 1) and the update (forward, backward, optimizer: the rest of the step),
with rollout/tokens_per_s. TRL's step time is the interval between its on_step_end
callbacks. Each case's first step (model warm-up) is left out of the median.

Target: TRL's step time ÷ Raylift's ≥ 1.0 (Raylift no slower). Both sample with plain
`generate` on CPU; TRL samples a step's prompts in one padded call, Raylift one call per
prompt's group (no padding: what makes a resumed step sample the same completions).

Sizes: RAYLIFT_BENCH_RL_HIDDEN, RAYLIFT_BENCH_RL_STEPS, RAYLIFT_BENCH_RL_PROMPTS (per
step), RAYLIFT_BENCH_RL_LENGTH (max completion tokens), RAYLIFT_BENCH_REPEATS."""

from __future__ import annotations

import inspect
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from tests.bench.benchutil import Check, results_dir, run_benchmark, size

HIDDEN = size("RAYLIFT_BENCH_RL_HIDDEN", 256, 32)
STEPS = size("RAYLIFT_BENCH_RL_STEPS", 8, 2, minimum=2)
PROMPTS = size("RAYLIFT_BENCH_RL_PROMPTS", 4, 1)
LENGTH = size("RAYLIFT_BENCH_RL_LENGTH", 32, 4)
G, LR = 8, 1e-3


def even_tokens(prompts, completions, completion_ids, **columns) -> list[float]:
    """The reward both sides score with: the share of even token ids in a completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def _assets() -> dict[str, Path]:
    from tools.tiny import build_all

    root = results_dir() / f"rl_tiny_h{HIDDEN}"
    if not (root / "model" / "config.json").exists():
        build_all(root, rows=200, hidden=HIDDEN, eval_rows=50)
    rows = [{"prompt": f"question {i}: what is {i} plus {i}?"} for i in range(PROMPTS * STEPS)]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(inspect.getsource(even_tokens))
    return {"model": root / "model", "prompts": prompts, "reward": root / "reward.py"}


def _raylift(_round: int) -> dict[str, float]:
    from trainer.config import load_config
    from trainer.rollouts.prompts import prepare_prompts
    from trainer.strategies.base import ModelSource, build_strategy

    a = _assets()
    cfg = load_config(
        {
            "model": {"path": str(a["model"])},
            "data": {"train_file": str(a["prompts"])},
            "train": {
                "objective": "grpo",
                "micro_batch_size": PROMPTS * G,
                "max_steps": STEPS,
                "seed": _round,
                "rl": {
                    "num_generations": G,
                    "max_completion_length": LENGTH,
                    "rewards": [{"function": f"{a['reward']}:even_tokens"}],
                },
            },
            "optim": {"lr": LR, "schedule": "constant", "grad_clip": 1.0},
            "scaling": {"num_workers": 1},
            "storage": {"path": str(results_dir() / "rl_runs")},
            "run": {"name": "bench-rl"},
        }
    )
    strategy = build_strategy(cfg, torch.device("cpu"), 0, 1)
    strategy.setup(ModelSource(a["model"], 0))
    strategy.model.train()
    objective = strategy.objective
    feed = objective.open_feed(prepare_prompts(cfg), [], 0, 1)
    objective.before_training(strategy, feed, None)
    step_s, phases = [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        micro = feed.micro_batches(step)
        total = sum(objective.count(m) for m in micro)
        for i, m in enumerate(micro):
            x, y, kw = objective.inputs(m, torch.device("cpu"))
            with strategy.accumulating(i == len(micro) - 1):
                strategy.train_micro(x, y, torch.tensor(float(total)), **kw)
        strategy.step()
        step_s.append(time.perf_counter() - t0)
        phases.append(objective.metrics(lambda v: v))
    keep = range(1, STEPS)
    generate = statistics.median(phases[i]["rollout/generate_s"] for i in keep)
    reward = statistics.median(phases[i]["rollout/reward_s"] for i in keep)
    step = statistics.median(step_s[i] for i in keep)
    return {
        "step_s": step,
        "generate_s": generate,
        "reward_s": reward,
        "update_s": step - generate - reward,
        "tokens_per_s": statistics.median(phases[i]["rollout/tokens_per_s"] for i in keep),
        "reward": phases[-1]["reward"],
    }


def _trl(_round: int) -> dict[str, float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    a = _assets()
    rows = [json.loads(x) for x in a["prompts"].read_text().splitlines()]
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(results_dir() / "rl_trl"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=LENGTH,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=_round,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(a["model"]),
        reward_funcs=[even_tokens],
        args=args,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Stamp()],
    )
    trainer.train()
    steps = [end - begin for begin, end in itertools.pairwise(stamps)]
    return {"step_s": statistics.median(steps[1:])}


def test_bench_grpo_step_against_trl():
    run_benchmark(
        "rl_grpo_step",
        title=f"GRPO step on CPU: Raylift vs TRL GRPOTrainer (hidden {HIDDEN}, {PROMPTS} "
        f"prompts × {G} generations, {LENGTH} tokens)",
        commands={"raylift": _raylift, "trl": _trl},
        checks=[
            Check(
                "trl_over_raylift_step_time",
                lambda r: r["trl"]["step_s"] / r["raylift"]["step_s"],
                1.0,
                unit="×",
            ),
            Check(
                "raylift_generate_share",
                lambda r: r["raylift"]["generate_s"] / r["raylift"]["step_s"],
                unit="×",
            ),
            Check("raylift_reward_s", lambda r: r["raylift"]["reward_s"], unit="s"),
            Check("raylift_update_s", lambda r: r["raylift"]["update_s"], unit="s"),
            Check(
                "raylift_rollout_tokens_per_s", lambda r: r["raylift"]["tokens_per_s"], unit="tok/s"
            ),
        ],
        metric="step_s",
        unit="s",
        setup={
            "hidden": HIDDEN,
            "steps": STEPS,
            "prompts": PROMPTS,
            "generations": G,
            "length": LENGTH,
        },
    )
