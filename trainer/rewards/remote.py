"""Rewards scored by Ray tasks (`train.rl.reward_workers` > 0), for rewards that execute
code or call a service: slow, CPU-hungry or unsafe work that should not run inside the
training process, whose GPU waits on it.

Each rank's completions are split into up to N contiguous chunks, one task each, spread
over the cluster's nodes. A task imports the functions by path where it runs (a relative
path against its working directory, which under a Ray job is the job's, unpacked on every
node) and streams one outcome per call, after a first "ready" once its functions are
loaded. The caller therefore times each call on its own from the previous outcome, not
from submission: a task waiting for a CPU or a fresh worker process is not a slow
reward. A call past `reward_timeout_s` has its task force-cancelled (its worker process
killed, so a hung reward takes no thread with it); a chunk that fails is searched row by
row by a second task, so the error names the reward, the prompt and the completion, as
in the process.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config.rl import RewardSpec
from trainer.rewards.checks import RewardError, batch_error, row_error, timeout_text
from trainer.rewards.chunks import Batch, Call, batch_calls, row_calls, rows_of, run_calls, split
from trainer.rewards.loading import load_function

START_TIMEOUT_S = 600.0
"""How long a reward task may wait for a CPU and load its functions before the run stops:
long enough for the autoscaler to bring a node up from zero."""


def _task(specs: list[RewardSpec], batch: Batch, calls: list[Call]) -> Iterator[tuple[str, Any]]:
    """A reward task's body: load the functions the calls need, say so, run the calls."""
    try:
        functions = {j: load_function(specs[j], Path.cwd()) for j in {j for j, _ in calls}}
    except RewardError as e:
        yield "load", str(e)
        return
    yield "ready", None
    yield from run_calls(functions, batch, calls)


@functools.cache
def _remote(cpus: float) -> Any:
    import ray

    # SPREAD: the chunks go to different nodes, and a task started from a Ray Train worker
    # is never placed in the training placement group (whose bundles the workers hold)
    return ray.remote(_task).options(num_cpus=cpus, max_retries=0, scheduling_strategy="SPREAD")


@dataclass
class _Run:
    """One task over one chunk: its calls, the outcomes so far, and when the last came."""

    batch: Batch
    calls: list[Call]
    gen: Any
    since: float
    started: bool = False
    outcomes: list[list[float]] = field(default_factory=list)
    fault: str | None = None
    done: bool = False

    @property
    def running(self) -> Call:
        """The call in flight (or the one that failed)."""
        return self.calls[len(self.outcomes)]


class RemoteRewards:
    """`Rewards.score` over Ray tasks: the same values in the same order, the same errors."""

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        timeout_s: float,
        workers: int,
        cpus: float = 1.0,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.specs, self.timeout_s, self.workers, self.cpus = list(specs), timeout_s, workers, cpus
        self.start_timeout_s = start_timeout_s

    def score(self, batch: Batch) -> list[list[float]]:
        """values[i][j]: reward j of completion i. Raises RewardError naming the row."""
        runs = [
            self._launch(batch.take(rows), batch_calls(len(self.specs)))
            for rows in split(len(batch), self.workers)
        ]
        self._drain(runs)
        failed = [(r.running[0], n) for n, r in enumerate(runs) if r.fault is not None]
        if failed:
            j, n = min(failed)
            raise self._find_row(j, runs[n])
        return [row for r in runs for row in rows_of(r.outcomes)]

    def _find_row(self, j: int, run: _Run) -> RewardError:
        """The error naming the first row of `run`'s chunk that fails reward `j` alone."""
        assert run.fault is not None
        search = self._launch(run.batch, row_calls(j, len(run.batch)))
        self._drain([search])
        if search.fault is None:
            return batch_error(j, self.specs[j], run.fault, len(run.batch))
        i = search.running[1]
        assert i is not None
        return row_error(
            j, self.specs[j], search.fault, run.batch.prompts[i], run.batch.completions[i]
        )

    def _launch(self, batch: Batch, calls: list[Call]) -> _Run:
        gen = _remote(self.cpus).remote(self.specs, batch, calls)
        return _Run(batch, calls, gen, time.monotonic())

    def _deadline(self, run: _Run) -> float:
        return run.since + (self.timeout_s if run.started else self.start_timeout_s)

    def _drain(self, runs: list[_Run]) -> None:
        """Reads every run's outcomes until each has all of them or a fault; a call past
        its time is a fault and its task is killed. Tasks left running are killed too."""
        import ray

        try:
            while active := [r for r in runs if not r.done]:
                wait_s = max(0.0, min(map(self._deadline, active)) - time.monotonic())
                gens = [r.gen for r in active]
                ray.wait(gens, num_returns=1, timeout=wait_s)
                ready, _ = ray.wait(gens, num_returns=len(gens), timeout=0)
                ready_ids = {id(g) for g in ready}
                for r in active:
                    if id(r.gen) in ready_ids:
                        self._take(r)
                now = time.monotonic()
                for r in active:
                    if r.done or now < self._deadline(r):
                        continue
                    if not r.started:
                        raise RewardError(
                            f"train.rl.reward_workers: a reward task did not start within "
                            f"{self.start_timeout_s:g} s; the cluster has no free "
                            f"{self.cpus:g} CPU for it (train.rl.reward_worker_cpus) beside the "
                            "training workers: add a node or lower reward_worker_cpus"
                        )
                    ray.cancel(r.gen, force=True)
                    r.fault, r.done = timeout_text(self.timeout_s), True
        finally:
            for r in runs:
                if not r.done:
                    ray.cancel(r.gen, force=True)

    def _take(self, run: _Run) -> None:
        import ray

        try:
            ref = next(run.gen)
        except StopIteration:
            run.done = True
            return
        try:
            kind, value = ray.get(ref)
        except Exception as e:  # the task itself died: a crash, an OOM kill, a lost node
            lines = str(e).strip().splitlines() or [""]
            run.fault, run.done = f"ended its Ray task ({type(e).__name__}: {lines[0]})", True
            return
        run.since = time.monotonic()
        if kind == "load":
            raise RewardError(value)
        if kind == "ready":
            run.started = True
        elif kind == "ok":
            run.outcomes.append(value)
            run.done = len(run.outcomes) == len(run.calls)
        else:
            run.fault, run.done = value, True
