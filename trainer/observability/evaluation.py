"""Evaluation: eval_loss (and perplexity) over the job's eval sets, every
train.eval_every steps and at the last step. It sits beside the step report it feeds:
the loop asks `Evaluation.due` at a reported step and adds `run()`'s figures to that
step's record. The benchmark scores (lm-evaluation-harness tasks, train.eval_tasks) come
through here too: `Benchmarks` (trainer.evaluation.component) decides their own cadence.

Every rank evaluates its share of each set and the sums meet in one all-reduce, so the
figure is the token-weighted mean over the whole set whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.config import JobConfig
from trainer.data.blocks import PackedBlocks, eval_indices
from trainer.data.tokenize import IGNORE

if TYPE_CHECKING:
    from trainer.distributed.seam import Runtime
    from trainer.evaluation.component import Benchmarks
    from trainer.strategies.base import Strategy

Attend = Callable[[list[np.ndarray]], dict[str, Any]]
"""A batch's segments → the model's attention arguments (the loop's `_attention`)."""


def target_count(labels: Any) -> int:
    """Predictions a causal-LM loss averages over: the labels after the one-token shift
    that are not IGNORE (numpy or torch)."""
    return int((labels[:, 1:] != IGNORE).sum())


def all_reduce_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    """`values` summed over every rank, through the job's process group."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


class Evaluation:
    """eval_loss every train.eval_every steps and at the last step, when there are eval
    sets; and the benchmarks when theirs is due."""

    def __init__(
        self,
        cfg: JobConfig,
        rt: Runtime,
        strategy: Strategy,
        device: torch.device,
        sets: dict[str, PackedBlocks],
        attend: Attend,
        benchmarks: Benchmarks,
    ):
        self.cfg, self.rt, self.strategy, self.device, self.sets = cfg, rt, strategy, device, sets
        self.attend, self.benchmarks = attend, benchmarks

    def _loss_due(self, done: int, is_last: bool) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.sets) and (is_last or bool(every and done % every == 0))

    def due(self, done: int, is_last: bool) -> bool:
        return self._loss_due(done, is_last) or self.benchmarks.due(done, is_last)

    def run(self, done: int, is_last: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._loss_due(done, is_last):
            out.update(
                evaluate_all(self.strategy, self.sets, self.cfg, self.rt, self.device, self.attend)
            )
        if self.benchmarks.due(done, is_last):
            out.update(self.benchmarks.run())
        return out


def evaluate_all(
    strategy: Strategy,
    sets: dict[str, PackedBlocks],
    cfg: JobConfig,
    rt: Runtime,
    device: torch.device,
    attend: Attend,
) -> dict[str, float]:
    """eval_loss over every eval source together (token-weighted), and with several
    sources, eval_loss/<name> for each."""
    parts = {
        name: _eval_sums(strategy, blocks, cfg, rt, device, attend) for name, blocks in sets.items()
    }
    loss_sum = sum(s for s, _ in parts.values())
    count = sum(n for _, n in parts.values())
    loss = loss_sum / max(count, 1.0)
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
    if len(parts) > 1:
        out.update({f"eval_loss/{k}": s / max(n, 1.0) for k, (s, n) in parts.items()})
    return out


def _eval_sums(
    strategy: Strategy,
    blocks: PackedBlocks,
    cfg: JobConfig,
    rt: Runtime,
    device: torch.device,
    attend: Attend,
) -> tuple[float, float]:
    """(loss × targets, targets) summed over every rank's eval batches."""
    loss_sum, count = 0.0, 0.0
    replica, replicas = cfg.data_rank(rt.rank, rt.world_size)
    with strategy.evaluating():
        for ix in eval_indices(
            len(blocks), cfg.train.micro_batch_size, replicas, replica, cfg.train.eval_limit
        ):
            ids, labels, *segs = blocks.gather(np.maximum(ix, 0))
            labels[ix < 0] = IGNORE  # a place past the eval set: the forward, no loss
            x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
            loss = strategy.eval_loss(x, y, **attend(segs))
            n = target_count(y)  # the predictions the loss averaged over
            if n:  # a batch of prompt tokens only has no loss (HF returns NaN for it)
                loss_sum += loss * n
                count += n
    loss_sum, count = all_reduce_sum([loss_sum, count], device, rt.world_size)
    return loss_sum, count
