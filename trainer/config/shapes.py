"""The shapes an SFT row may have and their fields, and the fields `data.columns` may map a
file's own columns to (every shape's, and the preference and KTO rows').

The config's own, below the data package: `data.columns` is checked against these names
when the job is validated (on the laptop, with the standard library), and
trainer.data.shapes reads rows by the same table, so a field is named in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str  # as reports print it
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    trained: str = ""  # what the loss sees, for reports and docs

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("text", ("text",), trained="every token"),
        Shape("input", ("input",), trained="every token (the Ray template's rows)"),
        Shape("prompt/completion", ("prompt", "completion"), trained="the completion"),
        Shape("alpaca", ("instruction", "output"), ("input", "system"), trained="the output"),
        Shape("chat", ("messages",), trained="the assistant turns"),
        Shape("tool use", ("messages",), ("tools",), trained="the assistant turns and calls"),
        Shape("sharegpt", ("conversations",), ("system",), trained="the gpt turns"),
    )
}
SHAPE_FIELDS = frozenset(f for s in SHAPES.values() for f in s.fields)
"""Every field some SFT shape reads: a row's other fields are extras."""
PAIR_FIELDS = ("prompt", "chosen", "rejected", "completion", "label")
"""Preference and KTO rows' fields (trainer.objectives.rows): also targets of data.columns."""
COLUMN_TARGETS = tuple(sorted(SHAPE_FIELDS | set(PAIR_FIELDS)))


def check_column_targets(columns: Mapping[str, str], known: Iterable[str] = COLUMN_TARGETS) -> None:
    """Raise ValueError naming an unknown target field of `data.columns` (config checks)."""
    known = tuple(known)
    for target, source in columns.items():
        if target not in known:
            raise ValueError(
                f"unknown target field {target!r} (mapped from column {source!r}); the fields "
                f"are {', '.join(known)}"
            )
        if not isinstance(source, str) or not source:
            raise ValueError(f"{target}: the file's column name must be a non-empty string")
