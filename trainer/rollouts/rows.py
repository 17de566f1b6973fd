"""A prompt row: a `prompt` (text, or chat messages) and the row's other columns, which
the reward functions receive. Standard library only at the top (and trainer.data.sources,
which is too): the laptop's preflight reads the first rows through it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.data.sources import ScanReport, iter_parsed, list_local


@dataclass(frozen=True)
class PromptRow:
    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any]


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def parse_prompt_row(obj: Any, columns: dict[str, str]) -> tuple[PromptRow | None, str | None]:
    """(the row, None) or (None, what is wrong with it); `columns` renames {prompt: col}."""
    if not isinstance(obj, dict):
        return None, f"a row is a JSON object with a 'prompt', got {type(obj).__name__}"
    key = columns.get("prompt", "prompt")
    if key not in obj:
        return None, f"no {key!r} field (the row has {sorted(obj)}); map it with data.columns"
    prompt = obj[key]
    if not (isinstance(prompt, str) and prompt.strip()) and not _is_chat(prompt):
        return None, f"{key!r} is neither text nor a list of {{role, content}} messages"
    return PromptRow(prompt, {k: v for k, v in obj.items() if k != key}), None


def sample_check(
    spec: str, what: str, on_bad_line: str, limit: int, columns: Mapping[str, str] | None = None
) -> str | None:
    """The laptop's quick look at the first prompt rows of the first local jsonl file."""
    if spec.startswith("s3://"):
        return f"{what} {spec}: S3 data is listed and checked on the cluster"
    first = list_local(spec)[0]
    if first.fmt not in (".jsonl", ".jsonl.gz"):
        return f"{what} {first.uri}: {first.fmt} rows are checked on the cluster"
    mapping = dict(columns or {})
    rows = iter_parsed(first, on_bad_line, ScanReport(), lambda o: parse_prompt_row(o, mapping))
    for seen, _ in enumerate(rows, 1):
        if seen >= limit:
            break
    return None
