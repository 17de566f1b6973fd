"""Reading the user's files: JSONL documents and the special-tokens file.

Pure (json only, no numpy): preflight reads the first lines of a data file on the laptop
before a job is submitted, and trainer.data reads every line when it tokenizes on the cluster,
with the same code, so a line is judged the same way in both places.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import DataError, UserError

TEXT_KEYS = ("text", "input")


def load_special_tokens(path: str | Path) -> list[str]:
    """Read a `{"tokens": [...]}` file (the Ray Llama template's tokens.json)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: special-tokens file not found") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise DataError(f'{path}: expected {{"tokens": ["<TOK>", ...]}} with non-empty strings')
    return tokens


@dataclass
class ScanReport:
    documents: int = 0
    skipped: int = 0
    first_skipped: list[str] = field(default_factory=list)


def _doc_text(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    for key in TEXT_KEYS:
        value = obj.get(key)
        if isinstance(value, str):
            return value
    return None


def iter_documents(path: Path, on_bad_line: str, report: ScanReport) -> Iterator[str]:
    """Yield each document's text; a malformed line raises DataError naming file:line, or,
    with on_bad_line=skip, is counted in `report` (never dropped silently)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            problem = None
            try:
                text = _doc_text(json.loads(raw))
                if text is None:
                    problem = 'expected an object with a string "text" or "input" field'
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problem = f"not valid JSON ({getattr(exc, 'msg', exc)})"
            if problem is not None:
                if on_bad_line == "error":
                    raise DataError(
                        f"{path}:{lineno}: {problem}; fix the line or set data.on_bad_line: skip"
                    )
                report.skipped += 1
                if len(report.first_skipped) < 5:
                    report.first_skipped.append(f"{path}:{lineno}: {problem}")
                continue
            report.documents += 1
            yield text
