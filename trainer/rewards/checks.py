"""What every reward call is checked for, and the one line a bad call stops the run with.

Shared by the in-process runner and the Ray tasks (`reward_workers`), so a reward that
raises, returns the wrong count, returns something that is not a finite number, or runs
too long reads the same wherever it ran: the function, what it did, and the row (prompt
and completion) that made it do so. A reward is never replaced by 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from trainer.config.rl import RewardSpec
from trainer.errors import UserError
from trainer.rewards.builtin import text_of


class RewardError(UserError):
    """A reward function failed on a row; the message names the function and the row."""


class Fault(Exception):
    """One call's failure, before the row that causes it is known."""

    def __init__(self, what: str, cause: BaseException | None = None):
        super().__init__(what)
        self.what, self.cause = what, cause


def checked_values(out: Any, count: int) -> list[float]:
    """`out` as floats when it is a list of `count` finite numbers; else a Fault that says
    what it was instead (bools are refused: a `True` is a bug, not a score)."""
    if not isinstance(out, Sequence) or isinstance(out, str | bytes):
        raise Fault(f"returned {type(out).__name__}, not a list of floats")
    if len(out) != count:
        raise Fault(f"returned {len(out)} values for {count} completions")
    for v in out:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            raise Fault(f"returned {v!r} (not a finite number)")
    return [float(v) for v in out]


def timeout_text(timeout_s: float) -> str:
    return f"ran past train.rl.reward_timeout_s = {timeout_s:g} s"


def short(value: Any, limit: int = 80) -> str:
    """A prompt or completion cut to fit in one line of an error."""
    text = repr(text_of(value) if not isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def row_error(j: int, spec: RewardSpec, what: str, prompt: Any, completion: Any) -> RewardError:
    """The error for reward `j` failing on one row."""
    return RewardError(
        f"train.rl.rewards[{j}] ({spec.function}) {what} on prompt {short(prompt)} and "
        f"completion {short(completion)}; fix the function (a reward is never replaced by 0)"
    )


def batch_error(j: int, spec: RewardSpec, what: str, batch: int) -> RewardError:
    """The error for reward `j` failing on a batch whose rows each pass alone."""
    return RewardError(
        f"train.rl.rewards[{j}] ({spec.function}) {what} on a batch of {batch} completions "
        "(each row alone passes); the function must score each completion independently"
    )
