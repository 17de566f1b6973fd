"""One rank of the 2-rank GRPO oracle check (torchrun, gloo, CPU, no Ray): for each case
(strategy, adapter, loss type), the strategy is built on the saved tiny Llama, this rank's
share of the fixed batch (tests.support.rl_batch: rank 0 rows 0-2, rank 1 rows 3-5, each
split into two micro batches) goes through the objective's inputs and the strategy's
train_micro as the loop runs it (the step's divisor over every rank, accumulation), and
rank 0 writes the step's loss and every trainable parameter's whole gradient to OUT, for
the test to compare with TRL's GRPOTrainer on one process.

python -m tests.support.rl_oracle_worker MODEL_DIR INPUTS OUT CASE... (CASE: ddp:none:dapo)

ZeRO-3 cases go last: transformers keeps ZeRO-3's config process-wide once set, and a
later from_pretrained would load partitioned."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.support.rl_batch import VOCAB, rl_batch
from trainer.config import load_config
from trainer.rollouts.generate import unwrap
from trainer.strategies.base import ModelSource, build_strategy

RANK_ROWS = [[[0], [1, 2]], [[3, 4], [5]]]
"""Each rank's micro batches (rows of rl_batch): accumulation 2 on unequal splits."""


def case_config(
    model: str, out: Path, strategy: str, adapter: str, loss_type: str, world: int = 2
) -> Any:
    """The job of one case: TRL's settings with num_iterations 2, beta 0.04, a sampling
    temperature and epsilon_high."""
    strat = {"name": "deepspeed", "config": "zero3"} if strategy == "zero3" else {"name": strategy}
    return load_config(
        {
            "model": {"path": model, "adapter": adapter},
            "data": {"train_file": "unused.jsonl"},
            "strategy": strat,
            "train": {
                "objective": "grpo",
                "micro_batch_size": 2,
                "grad_accum": 2,
                "max_steps": 1,
                "rl": {
                    "num_generations": 2,
                    "loss_type": loss_type,
                    "beta": 0.04,
                    "num_iterations": 2,
                    "temperature": 0.7,
                    "epsilon_high": 0.28,
                    "max_completion_length": 7,
                    "rewards": [{"function": "math_answer"}],
                },
            },
            "optim": {"lr": 1e-2, "schedule": "constant"},
            "scaling": {"num_workers": world},
            "storage": {"path": str(out.parent / "runs")},
            "run": {"name": "oracle"},
        }
    )


def micro_batch(rows: list[int], inputs: dict[str, torch.Tensor]) -> tuple[np.ndarray, ...]:
    """The feed's layout (trainer.objectives.grpo.BATCH) of `rows`."""
    b = rl_batch().rows(rows)
    return (
        b.ids.numpy(),
        b.attention.numpy(),
        b.completion_mask.numpy(),
        inputs["advantages"][rows].float().numpy(),
        inputs["old"][rows].float().numpy(),
        inputs["ref"][rows].float().numpy(),
    )


def full_grads(strategy: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient by the Hugging Face model's names (a
    DeepSpeed engine's start with module.), on every rank (collective under FSDP2 and
    ZeRO-3)."""
    from deepspeed.utils import safe_get_full_grad

    model = unwrap(strategy.model)
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = safe_get_full_grad(p) if hasattr(p, "ds_id") else p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        if g is not None:
            shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partition's whole shape
            out[name.removeprefix("module.")] = g.detach().double().cpu().reshape(shape)
    return out


def run_case(model: str, inputs: dict[str, torch.Tensor], out: Path, case: str) -> dict:
    strategy_name, adapter, loss_type = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = case_config(model, out, strategy_name, adapter, loss_type, world)
    strategy = build_strategy(cfg, torch.device("cpu"), rank, world)
    strategy.setup(ModelSource(Path(model), VOCAB))
    strategy.model.train()
    objective = strategy.objective
    micro = [micro_batch(rows, inputs) for rows in RANK_ROWS[rank]]
    total = torch.tensor(float(sum(objective.count(m) for m in micro)))
    dist.all_reduce(total)
    loss = torch.zeros((), dtype=torch.float64)
    for i, m in enumerate(micro):
        x, y, kw = objective.inputs(m, torch.device("cpu"))
        with strategy.accumulating(i == len(micro) - 1):
            loss += float(strategy.train_micro(x, y, total / world, **kw))
    dist.all_reduce(loss)
    return {"loss": float(loss) / world, "grads": full_grads(strategy)}


def main(model: str, inputs_path: str, out: str, *cases: str) -> None:
    dist.init_process_group("gloo")
    inputs = torch.load(inputs_path)
    results = {case: run_case(model, inputs, Path(out), case) for case in cases}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
