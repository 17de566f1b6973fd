"""Preference rows in the shapes TRL 1.16 reads, and KTO's unpaired rows. Standard
library only: the laptop's preflight samples local files with it.

A pair is recognised by its fields, never guessed:

- **explicit prompt**: `prompt`, `chosen`, `rejected`, all strings or all message lists
  (TRL's preference shape);
- **implicit prompt** (Anthropic HH-RLHF): only `chosen` and `rejected`, each the whole
  conversation; the prompt is their shared beginning, cut at a turn boundary: in text form
  just after the last shared `"\\n\\nAssistant:"`, in chat form the shared messages (TRL's
  `extract_prompt`; on text TRL cuts at the first differing character instead, which
  differs only when both answers begin alike, e.g. "Sure, ...": see docs/preference.md);
- **string prompt, conversational answers** (UltraFeedback-binarized): `prompt` a string,
  `chosen`/`rejected` whole conversations that repeat it as a user turn; read as the
  implicit shape, as TRL's `maybe_extract_prompt` does.

A row whose two completions are equal, or empty, teaches nothing and is an error, like a
missing field. So is a row that fits two shapes: a string or message `prompt` that
`chosen` and `rejected` both repeat would be read by TRL as an explicit prompt followed by
a second copy of it.

KTO's rows are TRL's unpaired preference shape: `prompt`, `completion` (both strings or
both message lists) and a boolean `label` (desirable or not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.data.sources import ScanReport, SourceFile, iter_parsed, list_local

FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED = ("prompt", "completion", "label")
Messages = tuple[tuple[str, str], ...]

EXPLICIT = "explicit prompt"
IMPLICIT = "implicit prompt (HH-RLHF)"
STRING_PROMPT = "string prompt, conversational answers (UltraFeedback)"
_MIXED = '"prompt", "chosen" and "rejected" must all be strings or all message lists'
ASSISTANT_TURN = "\n\nAssistant:"
"""Where an HH-RLHF text conversation hands the turn to the model."""


@dataclass(frozen=True)
class Pair:
    """One preference row: a shared prompt and two completions, all text or all chat, and
    the shape it was read as."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    shape: str = EXPLICIT

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


@dataclass(frozen=True)
class Unpaired:
    """One KTO row: a prompt, one completion and whether it is desirable."""

    prompt: str | Messages
    completion: str | Messages
    desirable: bool

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


def _shared(a: Any, b: Any) -> int:
    """How many leading items (characters, messages) `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _implicit_text(chosen: str, rejected: str) -> tuple[Pair | None, str | None]:
    common = chosen[: _shared(chosen, rejected)]
    cut = common.rfind(ASSISTANT_TURN)
    if cut < 0:
        return None, (
            f'"chosen" and "rejected" share no "{ASSISTANT_TURN.strip()}" turn to take the '
            'prompt from (HH-RLHF text: "\\n\\nHuman: ...\\n\\nAssistant: ..."); add a '
            '"prompt" field'
        )
    end = cut + len(ASSISTANT_TURN)
    return Pair(chosen[:end], chosen[end:], rejected[end:], IMPLICIT), None


def _implicit_chat(
    chosen: Messages, rejected: Messages, shape: str
) -> tuple[Pair | None, str | None]:
    n = _shared(chosen, rejected)
    if n == 0:
        return None, (
            '"chosen" and "rejected" share no first message to take the prompt from; add a '
            '"prompt" field with the conversation before the answers'
        )
    return Pair(chosen[:n], chosen[n:], rejected[n:], shape), None


def _string_prompt(
    prompt: str, chosen: Messages, rejected: Messages
) -> tuple[Pair | None, str | None]:
    pair, problem = _implicit_chat(chosen, rejected, STRING_PROMPT)
    if pair is None:
        return None, (f'"prompt" is a string but "chosen"/"rejected" are conversations: {problem}')
    users = [c for r, c in pair.prompt if r == "user"]  # type: ignore[union-attr]
    if not users or users[-1].strip() != prompt.strip():
        return None, (
            '"prompt" is a string but the conversations in "chosen"/"rejected" do not repeat it '
            'as their last shared user turn; give "prompt" as a message list instead'
        )
    return pair, None


def _repeats(prompt: Any, side: Any) -> bool:
    return len(side) > len(prompt) and side[: len(prompt)] == prompt


def parse_pair(obj: Any) -> tuple[Pair | None, str | None]:
    """A row's pair and the shape it was read as, or why it has none."""
    if not isinstance(obj, dict):
        return None, 'expected an object with "chosen" and "rejected" fields'
    if obj.get("chosen") is None or obj.get("rejected") is None:
        if all(obj.get(f) is not None for f in UNPAIRED):
            return None, (
                'a "prompt"/"completion"/"label" row is unpaired feedback: set '
                'train.objective: kto, or give "chosen" and "rejected"'
            )
        missing = [f for f in ("chosen", "rejected") if obj.get(f) is None]
        return None, (
            f"missing field {', '.join(repr(m) for m in missing)} (a preference row has "
            '"chosen" and "rejected", and "prompt" unless they share it)'
        )
    chosen, rejected, prompt = obj["chosen"], obj["rejected"], obj.get("prompt")
    pair, problem = _read_pair(prompt, chosen, rejected)
    if pair is None:
        return None, problem
    for name in ("chosen", "rejected"):
        if _empty(getattr(pair, name)):
            return None, f'"{name}" is empty: there is no completion to compare'
    if pair.chosen == pair.rejected:
        return None, '"chosen" equals "rejected": the pair prefers nothing'
    return pair, None


def _read_pair(prompt: Any, chosen: Any, rejected: Any) -> tuple[Pair | None, str | None]:
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            return _implicit_text(chosen, rejected)
        if not isinstance(prompt, str):
            return None, _MIXED
        if prompt and _repeats(prompt, chosen) and _repeats(prompt, rejected):
            return None, _twice()
        return Pair(prompt, chosen, rejected), None
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        return None, '"chosen" and "rejected" must both be strings or both message lists'
    parsed = []
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        msgs, problem = _messages(v, name)
        if msgs is None:
            return None, problem
        parsed.append(msgs)
    c, r = parsed
    if prompt is None:
        return _implicit_chat(c, r, IMPLICIT)
    if isinstance(prompt, str):
        return _string_prompt(prompt, c, r)
    p, problem = _messages(prompt, "prompt")
    if p is None:
        return None, problem
    if _repeats(p, c) and _repeats(p, r):
        return None, _twice()
    return Pair(p, c, r), None


def _twice() -> str:
    return (
        f'the row fits two shapes, {EXPLICIT} and {IMPLICIT}: "chosen" and "rejected" both '
        'repeat "prompt"; drop "prompt", or remove it from the answers'
    )


def parse_unpaired(obj: Any) -> tuple[Unpaired | None, str | None]:
    """A KTO row (TRL's unpaired preference shape), or why it is not one."""
    if not isinstance(obj, dict):
        return None, 'expected an object with "prompt", "completion" and "label" fields'
    missing = [f for f in UNPAIRED if obj.get(f) is None]
    if missing:
        hint = (
            ' (a "chosen"/"rejected" row is a pair: use train.objective: dpo)'
            if "chosen" in obj and "rejected" in obj
            else ""
        )
        return None, (
            f"missing field {', '.join(repr(m) for m in missing)} (a KTO row has "
            f'"prompt", "completion" and a true/false "label"){hint}'
        )
    label = obj["label"]
    if not isinstance(label, bool):
        return None, f'"label" must be true or false (desirable or not), got {label!r}'
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        row = Unpaired(prompt, completion, label)
    elif isinstance(prompt, list) and isinstance(completion, list):
        p, problem = _messages(prompt, "prompt")
        c, problem_c = _messages(completion, "completion")
        if p is None or c is None:
            return None, problem or problem_c
        row = Unpaired(p, c, label)
    else:
        return None, '"prompt" and "completion" must both be strings or both message lists'
    if _empty(row.completion):
        return None, '"completion" is empty: there is nothing to judge'
    return row, None


def iter_pairs(
    src: SourceFile,
    on_bad_line: str,
    report: ScanReport,
    endpoint: str | None = None,
    region: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Any:
    """Each row's Pair; a bad row raises DataError naming file:line (file:row N for
    parquet), or, with on_bad_line=skip, is counted in `report`."""
    return iter_parsed(src, on_bad_line, report, parse_pair, endpoint, region, columns)


def iter_unpaired(
    src: SourceFile,
    on_bad_line: str,
    report: ScanReport,
    endpoint: str | None = None,
    region: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Any:
    """Each KTO row, with iter_pairs' handling of bad rows."""
    return iter_parsed(src, on_bad_line, report, parse_unpaired, endpoint, region, columns)


def sample_check(
    spec: str,
    what: str,
    on_bad_line: str,
    limit: int,
    unpaired: bool = False,
    columns: Mapping[str, str] | None = None,
) -> str | None:
    """The laptop's quick look at the first rows of the first local jsonl(.gz) file: a
    note saying the shape they were read as (validation prints it), or a bad row's error."""
    if spec.startswith("s3://"):
        return f"{what} {spec}: S3 data is listed and checked on the cluster"
    first = list_local(spec)[0]
    if first.fmt not in (".jsonl", ".jsonl.gz"):
        return f"{what} {first.uri}: {first.fmt} rows are checked on the cluster"
    scan = ScanReport()
    rows = (iter_unpaired if unpaired else iter_pairs)(first, on_bad_line, scan, columns=columns)
    shapes: dict[str, int] = {}
    for seen, row in enumerate(rows, 1):
        shape = "KTO rows (prompt, completion, label)" if unpaired else f"pairs, {row.shape}"
        shapes[shape] = shapes.get(shape, 0) + 1
        if seen >= limit:
            break
    mapped = f" (columns {dict(columns)})" if columns else ""
    read = "; ".join(f"{shape} ({n} of the first rows)" for shape, n in shapes.items())
    return f"{what} {spec}: read as {read or 'nothing'}{mapped}"
