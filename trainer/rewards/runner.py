"""Loading the job's reward functions and calling them, checked.

A reward that raises, returns the wrong count, returns something that is not a finite
number, or runs past `train.rl.reward_timeout_s` stops the run with a `RewardError`
naming the reward and the row (prompt and completion) that caused it. It never becomes a
silent 0: a wrong reward trains the wrong model at full price. A batch that fails is
retried row by row to find the row; a failure only the whole batch shows names the batch.
In the process, calls run on a daemon thread so a reward that never returns cannot keep
the worker alive; with `train.rl.reward_workers` they run as Ray tasks (remote.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.config.rl import RewardSpec
from trainer.rewards.checks import (
    Fault,
    RewardError,
    batch_error,
    checked_values,
    row_error,
    timeout_text,
)
from trainer.rewards.chunks import Batch
from trainer.rewards.loading import load_function
from trainer.rewards.remote import RemoteRewards

__all__ = ["RewardError", "Rewards", "load_function"]


class _Timeout(Exception):
    pass


class Rewards:
    """The job's reward functions: `score` gives one row of values per completion.

    `workers` > 0 scores in that many Ray tasks of `cpus` CPUs each; the functions are
    then loaded where the tasks run, not here (a reward that starts a sandbox or opens a
    connection when imported does so on the task's node only)."""

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        timeout_s: float,
        base: Path | None = None,
        workers: int = 0,
        cpus: float = 1.0,
    ):
        base = base or Path.cwd()
        self.specs = list(specs)
        self.names = [s.name for s in self.specs]
        self.weights = [s.weight for s in self.specs]
        self.timeout_s = timeout_s
        self.remote = RemoteRewards(self.specs, timeout_s, workers, cpus) if workers else None
        self.functions = [] if workers else [load_function(s, base) for s in self.specs]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: dict[str, Sequence[Any]],
        completion_ids: Sequence[Sequence[int]],
    ) -> list[list[float]]:
        """values[i][j]: reward j of completion i. Raises RewardError naming the row."""
        if self.remote is not None:
            return self.remote.score(Batch.of(prompts, completions, columns, completion_ids))
        per_function = [
            self._one(j, prompts, completions, columns, completion_ids)
            for j in range(len(self.functions))
        ]
        return [list(row) for row in zip(*per_function, strict=True)]

    def _one(self, j, prompts, completions, columns, completion_ids) -> list[float]:
        try:
            return self._checked(j, prompts, completions, columns, completion_ids)
        except Fault as whole:
            for i in range(len(completions)):
                try:
                    self._checked(
                        j,
                        [prompts[i]],
                        [completions[i]],
                        {k: [v[i]] for k, v in columns.items()},
                        [completion_ids[i]],
                    )
                except Fault as row:
                    spec = self.specs[j]
                    raise row_error(j, spec, row.what, prompts[i], completions[i]) from row.cause
            raise batch_error(j, self.specs[j], whole.what, len(completions)) from whole.cause

    def _checked(self, j, prompts, completions, columns, completion_ids) -> list[float]:
        fn = self.functions[j]
        try:
            out = _call(
                fn,
                self.timeout_s,
                list(prompts),
                list(completions),
                completion_ids=list(completion_ids),
                **{k: list(v) for k, v in columns.items()},
            )
        except _Timeout as e:
            raise Fault(timeout_text(self.timeout_s), e) from e
        except Exception as e:
            raise Fault(f"raised {type(e).__name__}: {e}", e) from e
        return checked_values(out, len(completions))


def _call(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a daemon thread, waited on for at most `timeout_s`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="reward", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box["out"]
