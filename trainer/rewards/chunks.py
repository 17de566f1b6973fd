"""A step's completions cut into chunks for reward tasks, and what one task does.

Chunks are contiguous and in order, so the scores join back in the completions' order by
concatenation. A task makes a list of calls, each one function over some rows of its
chunk (the whole chunk first; one row at a time when looking for the row that failed),
and reports each call's outcome as soon as it has one: the caller then always knows
which call is running, so a call that never returns is named as precisely as one that
raises. The task stops at its first bad call; the caller decides what to run next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.rewards.checks import Fault, checked_values

Call = tuple[int, int | None]
"""(function index, row index in the chunk; None = every row of the chunk)."""


def split(count: int, workers: int) -> list[range]:
    """Up to `workers` contiguous, non-empty ranges over `count` rows, in order, whose
    sizes differ by at most one (never an empty chunk: it would cost a task for nothing)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    parts = min(workers, count)
    size, extra = divmod(count, parts) if parts else (0, 0)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


@dataclass(frozen=True)
class Batch:
    """The rows a reward scores: prompts, completions, the rows' other columns and the
    completions' token ids, one entry per completion."""

    prompts: list[Any]
    completions: list[Any]
    columns: dict[str, list[Any]]
    completion_ids: list[list[int]]

    @classmethod
    def of(
        cls,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: dict[str, Sequence[Any]],
        completion_ids: Sequence[Sequence[int]],
    ) -> Batch:
        return cls(
            list(prompts),
            list(completions),
            {k: list(v) for k, v in columns.items()},
            [list(ids) for ids in completion_ids],
        )

    def __len__(self) -> int:
        return len(self.completions)

    def take(self, rows: Sequence[int]) -> Batch:
        return Batch(
            [self.prompts[i] for i in rows],
            [self.completions[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in self.columns.items()},
            [self.completion_ids[i] for i in rows],
        )


def batch_calls(functions: int) -> list[Call]:
    """A chunk's first task: each function over the whole chunk."""
    return [(j, None) for j in range(functions)]


def row_calls(j: int, rows: int) -> list[Call]:
    """The search for the row that fails function `j`: one row at a time, in order."""
    return [(j, i) for i in range(rows)]


def run_calls(
    functions: Sequence[Callable[..., Any]], batch: Batch, calls: Sequence[Call]
) -> Iterator[tuple[str, Any]]:
    """("ok", values) or ("fault", what) for each call in turn, stopping after the first
    fault. This is a reward task's body; it runs here in the process too."""
    for j, row in calls:
        part = batch if row is None else batch.take([row])
        try:
            out = functions[j](
                part.prompts,
                part.completions,
                completion_ids=part.completion_ids,
                **part.columns,
            )
            values = checked_values(out, len(part))
        except Fault as f:
            yield "fault", f.what
            return
        except Exception as e:
            yield "fault", f"raised {type(e).__name__}: {e}"
            return
        yield "ok", values


def rows_of(values: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per-function value lists turned into one row of values per completion."""
    return [list(row) for row in zip(*values, strict=True)]
