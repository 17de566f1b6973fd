"""One rank of a 2-rank GRPO run without Ray (torchrun, gloo): two steps through the
strategy as the loop runs them (the step divisor over ranks, accumulation, the optimizer
step), writing each step's completions, loss and reward to OUT.rank<r>.json.

python -m tests.support.rl_worker STRATEGY MODEL_DIR PROMPTS OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import load_config
from trainer.rollouts.prompts import prepare_prompts
from trainer.strategies.base import ModelSource, build_strategy

STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "config": "zero3"},
}


def main(strategy_name: str, model: str, prompts: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(
        {
            "model": {"path": model},
            "data": {"train_file": prompts},
            "strategy": STRATEGIES[strategy_name],
            "train": {
                "objective": "grpo",
                "micro_batch_size": 4,
                "grad_accum": 2,
                "max_steps": 2,
                "rl": {
                    "num_generations": 4,
                    "max_completion_length": 6,
                    "rewards": [{"function": "format_regex", "options": {"pattern": "e"}}],
                    "beta": 0.04,
                },
            },
            "optim": {"lr": 1e-2, "schedule": "constant"},
            "scaling": {"num_workers": world},
            "storage": {"path": str(Path(out).parent / "runs")},
            "run": {"name": "rl"},
        }
    )
    strategy = build_strategy(cfg, torch.device("cpu"), rank, world)
    strategy.setup(ModelSource(Path(model), 0))
    strategy.model.train()
    objective = strategy.objective
    if rank == 0:
        folders = prepare_prompts(cfg)
    dist.barrier()
    folders = prepare_prompts(cfg) if rank else folders  # the cache rank 0 wrote
    feed = objective.open_feed(folders, [], rank, world)
    objective.before_training(strategy, feed, None)
    steps = []
    for step in range(2):
        micro = feed.micro_batches(step)
        total = torch.tensor(float(sum(objective.count(m) for m in micro)))
        dist.all_reduce(total)
        loss = 0.0
        for i, m in enumerate(micro):
            x, y, kw = objective.inputs(m, torch.device("cpu"))
            with strategy.accumulating(i == len(micro) - 1):
                loss += float(strategy.train_micro(x, y, total / world, **kw))
        strategy.step()
        metrics = objective.metrics(_sum)
        steps.append(
            {
                "ids": [m[0].tolist() for m in micro],
                "loss": loss,
                "reward": metrics["reward"],
                "kl": metrics["kl"],
            }
        )
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def _sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


if __name__ == "__main__":
    main(*sys.argv[1:5])
