"""The loop's benchmark component: train.eval_tasks scored before step 1, every
train.eval_tasks_every steps and at the last step, with the model as the strategy holds
it. The eval-loss component (trainer.observability.evaluation) asks it at a reported step
and adds its scores (`eval/<task>/<metric>`) to that step's record, so they reach
metrics.jsonl, the trackers, `status` and the report's plot with the loss.

Every rank runs lm-eval's flow and takes part in each forward (trainer.evaluation.sharded);
rank 0's scores are broadcast so every rank returns the same record.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.config import JobConfig

if TYPE_CHECKING:
    from trainer.strategies.base import Strategy

log = logging.getLogger(__name__)

BEFORE_TRAINING = 0
"""The step a run's scores before its first step are recorded at."""


class Benchmarks:
    """No tasks: never due (a no-op the loop need not branch on)."""

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world: int,
        strategy: Strategy,
        tokenizer: Any,
        device: torch.device,
    ):
        self.tasks, self.every = list(cfg.train.eval_tasks), cfg.train.eval_tasks_every
        self.limit = cfg.train.eval_tasks_limit
        self.rank, self.world = rank, world
        self.strategy, self.tokenizer, self.device = strategy, tokenizer, device

    def due(self, done: int, is_last: bool) -> bool:
        return bool(self.tasks) and (is_last or bool(self.every and done % self.every == 0))

    def run(self) -> dict[str, float]:
        """Every task's scores (collective); the same dict on every rank. lm-eval is
        imported only here: a run without tasks does not pay its seconds of import."""
        from trainer.evaluation.sharded import ShardedLM
        from trainer.evaluation.tasks import evaluate, scores

        started = time.perf_counter()
        with self.strategy.evaluating():
            lm = ShardedLM(
                self.strategy, self.tokenizer, self.device, rank=self.rank, world=self.world
            )
            results = evaluate(lm, self.tasks, self.limit)
        found = [scores(results) if results is not None else {}]
        if self.world > 1 and dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        out = found[0]
        if self.rank == 0:
            log.info(
                "benchmarks in %.1f s: %s",
                time.perf_counter() - started,
                ", ".join(f"{k} {v:.4f}" for k, v in sorted(out.items())),
            )
        return out

    def before_training(self, report: Any, start: int) -> None:
        """The curve's first point: the scores of the model as loaded, on a run's first
        start (a resumed run has it already), recorded as a `benchmark` event at step 0.
        `report` is the loop's StepReport (its metrics file and trackers)."""
        if not self.tasks or start != 0:
            return
        values = self.run()
        record = {"step": BEFORE_TRAINING, "time": time.time(), **values}
        if report.metrics_file is not None:
            report.metrics_file.write(
                {"event": "benchmark", "attempt": report.metrics_file.attempt, **record}
            )
        report.tracker.metrics(record)
