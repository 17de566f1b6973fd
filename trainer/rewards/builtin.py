"""The built-in rewards, with TRL's signature `(prompts, completions, **columns)`.

- math_answer: 1.0 when the completion's final answer equals the row's reference answer
  (GSM8K writes it after `#### `; a model may box it as `\\boxed{...}`), else 0.0.
- format_regex: 1.0 when the completion matches a regular expression, else 0.0.
- length_target: 1 - |length - target| / target, floored at 0: 1.0 at the target length
  (tokens by default, or characters).

A chat prompt's completion is a list with one assistant message, as TRL passes it; each
built-in reads its text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of a chat completion's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def final_answer(text: str) -> str | None:
    """The answer a text commits to: its last \\boxed{}, else what follows its last
    `####`, else its last number; None when it has none of them."""
    for pattern in (_BOXED, _HASHES):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str:
    """1,000 / $1000 / 1000.0 / 1000. all read 1000; anything else compares as text."""
    s = answer.strip().strip("$").rstrip(".").replace(",", "").replace(" ", "")
    try:
        value = float(s)
    except ValueError:
        return s
    return repr(int(value)) if value == int(value) else repr(value)


def math_answer(
    prompts: Sequence[Any], completions: Sequence[Any], column: str = "answer", **columns: Any
) -> list[float]:
    if column not in columns:
        raise KeyError(
            f"math_answer needs the reference answer in a column {column!r} of the prompt "
            f"rows (the rows have {sorted(k for k in columns if k != 'completion_ids')}); "
            "set options.column"
        )
    out = []
    for completion, reference in zip(completions, columns[column], strict=True):
        ref = final_answer(str(reference))
        got = final_answer(text_of(completion))
        out.append(float(ref is not None and got is not None and _normal(got) == _normal(ref)))
    return out


def format_regex(
    prompts: Sequence[Any], completions: Sequence[Any], pattern: str = "", **columns: Any
) -> list[float]:
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.search(text_of(c)) is not None) for c in completions]


def length_target(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    target: int = 0,
    unit: str = "tokens",
    completion_ids: Sequence[Sequence[int]] | None = None,
    **columns: Any,
) -> list[float]:
    if target < 1:
        raise ValueError("length_target needs options.target >= 1")
    if unit == "tokens":
        assert completion_ids is not None
        lengths = [len(ids) for ids in completion_ids]
    else:
        lengths = [len(text_of(c)) for c in completions]
    return [max(0.0, 1.0 - abs(n - target) / target) for n in lengths]


BUILTINS: dict[str, Callable[..., list[float]]] = {
    "math_answer": math_answer,
    "format_regex": format_regex,
    "length_target": length_target,
}
