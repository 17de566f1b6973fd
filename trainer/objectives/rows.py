"""Preference rows: {prompt, chosen, rejected}, as plain text or as chat messages (TRL's
two shapes). Standard library only: the laptop's preflight samples local files with it.

A chat row's prompt is a list of messages (the conversation up to the answer) and its
chosen and rejected are lists of messages too (usually one assistant turn each); a
plain row's three fields are strings. A row whose two completions are equal, or empty,
teaches nothing and is an error, like a missing field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.data.sources import ScanReport, SourceFile, iter_parsed, list_local

FIELDS = ("prompt", "chosen", "rejected")
Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Pair:
    """One preference row: a shared prompt and two completions, all text or all chat."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _messages(value: Any, name: str) -> tuple[Messages | None, str | None]:
    if not isinstance(value, list) or not value:
        return None, f'"{name}" must be a string or a non-empty list of {{"role", "content"}}'
    out = []
    for i, m in enumerate(value):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            return None, f'{name}[{i}]: expected {{"role": str, "content": str}}'
        out.append((m["role"], m["content"]))
    return tuple(out), None


def _empty(value: str | Messages) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not any(content.strip() for _, content in value)


def parse_pair(obj: Any) -> tuple[Pair | None, str | None]:
    """A row's pair, or why it has none."""
    if not isinstance(obj, dict):
        return None, 'expected an object with "prompt", "chosen" and "rejected" fields'
    missing = [f for f in FIELDS if obj.get(f) is None]
    if missing:
        return (
            None,
            f"missing field {', '.join(repr(m) for m in missing)} (a preference row has "
            '"prompt", "chosen" and "rejected")',
        )
    values = [obj[f] for f in FIELDS]
    if all(isinstance(v, str) for v in values):
        parsed = values
    elif all(isinstance(v, list) for v in values):
        parsed = []
        for name, v in zip(FIELDS, values, strict=True):
            msgs, problem = _messages(v, name)
            if msgs is None:
                return None, problem
            parsed.append(msgs)
    else:
        return None, '"prompt", "chosen" and "rejected" must all be strings or all message lists'
    pair = Pair(*parsed)
    for name in ("chosen", "rejected"):
        if _empty(getattr(pair, name)):
            return None, f'"{name}" is empty: there is no completion to compare'
    if pair.chosen == pair.rejected:
        return None, '"chosen" equals "rejected": the pair prefers nothing'
    return pair, None


def iter_pairs(
    src: SourceFile,
    on_bad_line: str,
    report: ScanReport,
    endpoint: str | None = None,
    region: str | None = None,
) -> Any:
    """Each row's Pair; a bad row raises DataError naming file:line (file:row N for
    parquet), or, with on_bad_line=skip, is counted in `report`."""
    return iter_parsed(src, on_bad_line, report, parse_pair, endpoint, region)


def sample_check(spec: str, what: str, on_bad_line: str, limit: int) -> str | None:
    """The laptop's quick look at the first rows of the first local jsonl(.gz) file."""
    if spec.startswith("s3://"):
        return f"{what} {spec}: S3 data is listed and checked on the cluster"
    first = list_local(spec)[0]
    if first.fmt not in (".jsonl", ".jsonl.gz"):
        return f"{what} {first.uri}: {first.fmt} rows are checked on the cluster"
    scan = ScanReport()
    for seen, _ in enumerate(iter_pairs(first, on_bad_line, scan), 1):
        if seen >= limit:
            break
    return None
