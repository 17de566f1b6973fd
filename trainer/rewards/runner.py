"""Loading the job's reward functions and calling them, checked.

A reward that raises, returns the wrong count, returns something that is not a finite
number, or runs past `train.rl.reward_timeout_s` stops the run with a `RewardError`
naming the reward and the row (prompt and completion) that caused it. It never becomes a
silent 0: a wrong reward trains the wrong model at full price. A batch that fails is
retried row by row to find the row; a failure only the whole batch shows names the batch.
Calls run on a daemon thread so a reward that never returns cannot keep the worker alive.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.config.rl import RewardSpec
from trainer.errors import UserError
from trainer.rewards.builtin import BUILTINS, text_of


class RewardError(UserError):
    """A reward function failed on a row; the message names the function and the row."""


class _Timeout(Exception):
    pass


def load_function(spec: RewardSpec, base: Path) -> Callable[..., Any]:
    """The callable `spec` names: a built-in with its options bound, or `name` from the
    file (relative to `base`), imported under a module name of its own."""
    if spec.location is None:
        fn = BUILTINS[spec.function]
        options = dict(spec.options)
        return lambda prompts, completions, **cols: fn(prompts, completions, **options, **cols)
    file, name = spec.location
    path = (base / file).resolve()
    where = f"train.rl.rewards: {spec.function}"
    if not path.is_file():
        raise RewardError(f"{where}: no file {path}; give the path relative to {base}")
    module_name = f"raylift_reward_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, path)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            raise RewardError(
                f"{where}: importing {path} raised {type(e).__name__}: {e}; fix the file"
            ) from e
        sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{where}: {path} has no function {name!r}; check the name")
    return fn


def _short(value: Any, limit: int = 80) -> str:
    text = repr(text_of(value) if not isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Rewards:
    """The job's reward functions: `score` gives one row of values per completion."""

    def __init__(self, specs: Sequence[RewardSpec], timeout_s: float, base: Path | None = None):
        base = base or Path.cwd()
        self.specs = list(specs)
        self.names = [s.name for s in self.specs]
        self.weights = [s.weight for s in self.specs]
        self.timeout_s = timeout_s
        self.functions = [load_function(s, base) for s in self.specs]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: dict[str, Sequence[Any]],
        completion_ids: Sequence[Sequence[int]],
    ) -> list[list[float]]:
        """values[i][j]: reward j of completion i. Raises RewardError naming the row."""
        per_function = [
            self._one(j, prompts, completions, columns, completion_ids)
            for j in range(len(self.functions))
        ]
        return [list(row) for row in zip(*per_function, strict=True)]

    def _one(self, j, prompts, completions, columns, completion_ids) -> list[float]:
        try:
            return self._checked(j, prompts, completions, columns, completion_ids)
        except _Fault as whole:
            for i in range(len(completions)):
                try:
                    self._checked(
                        j,
                        [prompts[i]],
                        [completions[i]],
                        {k: [v[i]] for k, v in columns.items()},
                        [completion_ids[i]],
                    )
                except _Fault as row:
                    raise self._error(j, row.what, prompts[i], completions[i]) from row.cause
            raise self._error(j, whole.what, None, None, len(completions)) from whole.cause

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
            raise _Fault(f"ran past train.rl.reward_timeout_s = {self.timeout_s:g} s", e) from e
        except Exception as e:
            raise _Fault(f"raised {type(e).__name__}: {e}", e) from e
        if not isinstance(out, Sequence) or isinstance(out, str | bytes):
            raise _Fault(f"returned {type(out).__name__}, not a list of floats", None)
        if len(out) != len(completions):
            raise _Fault(f"returned {len(out)} values for {len(completions)} completions", None)
        for v in out:
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
                raise _Fault(f"returned {v!r} (not a finite number)", None)
        return [float(v) for v in out]

    def _error(
        self, j: int, what: str, prompt: Any, completion: Any, batch: int = 0
    ) -> RewardError:
        spec = self.specs[j]
        head = f"train.rl.rewards[{j}] ({spec.function}) {what}"
        if batch:
            return RewardError(
                f"{head} on a batch of {batch} completions (each row alone passes); the "
                "function must score each completion independently"
            )
        return RewardError(
            f"{head} on prompt {_short(prompt)} and completion {_short(completion)}; fix the "
            "function (a reward is never replaced by 0)"
        )


class _Fault(Exception):
    def __init__(self, what: str, cause: BaseException | None):
        super().__init__(what)
        self.what, self.cause = what, cause


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
