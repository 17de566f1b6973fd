"""What an SFT row means, decided by its fields, never guessed; and `data.columns`, the
mapping from a file's own column names to a shape's fields.

A row fits a shape when it has every field the shape requires and no field of another
shape (`SHAPE_FIELDS`); other fields are extras, allowed and listed once. The old reader
took a row by the first field it recognised, so an Alpaca row (`instruction`, `input`,
`output`) was read as the Ray template's `{"input": ...}` text and trained on its input
alone. Here that row fits Alpaca only, and a row that fits two shapes (or none) is an error
that names the fields, never read as one of them.

A source has one shape: its first row decides it, and every later row must fit it too
(`RowReader`; shapes that mean the same may mix, `FAMILY`), so a file that drifts
between shapes fails at file:line instead of training on a mixture nobody meant.

Standard library only: the laptop's preflight samples local files with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from trainer.config.shapes import SHAPE_FIELDS, SHAPES, Shape
from trainer.data.sources import Example, ScanReport, SourceFile, iter_parsed, list_local
from trainer.errors import DataError, UserError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
"""ShareGPT's `from` values → chat roles. A `function_call` turn is the assistant calling a
tool (its value the call, as text) and an `observation` is the tool's answer."""

ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.",
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.",
)
"""The Stanford Alpaca project's prompt preambles (with an input, without one): the
prompt an Alpaca row is trained under when no chat template is at hand."""


# ---------------------------------------------------------------- which shape


def _messages_shape(value: Any, field: str) -> str | None:
    """chat, tool use or sharegpt, by the keys of the list's items; None when neither."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        return None
    if all("from" in m and "value" in m for m in value):
        return "sharegpt"
    if field == "messages" and all("role" in m for m in value):
        tools = any(m.get("tool_calls") or m.get("role") == "tool" for m in value)
        return "tool use" if tools else "chat"
    return None


def fit(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """The one shape a row fits, or a one-line reason naming the fields."""
    have = [k for k in row if k in SHAPE_FIELDS]
    candidates = [s for s in SHAPES.values() if all(f in row for f in s.required)]
    exact = [s for s in candidates if set(have) <= set(s.fields)]
    if "conversations" in row:
        exact = [s for s in exact if s.name == "sharegpt"]
    if "messages" in row:
        kind = _messages_shape(row["messages"], "messages")
        if kind == "sharegpt" and set(have) <= {"messages", "system"}:
            return "sharegpt", None
        if kind == "tool use" or (kind == "chat" and "tools" in row):
            exact = [s for s in exact if s.name == "tool use"]
        elif kind == "chat":
            exact = [s for s in exact if s.name == "chat"]
        elif exact:
            return None, (
                '"messages" must be a non-empty list of {"role", "content"} (or ShareGPT\'s '
                '{"from", "value"}) objects'
            )
    if len(exact) == 1:
        return exact[0].name, None
    fields = ", ".join(have) or "none of " + ", ".join(sorted(SHAPE_FIELDS))
    distinct: list[Shape] = []  # chat and tool use require the same field: name chat
    for shape in candidates:
        if all(d.required != shape.required for d in distinct):
            distinct.append(shape)
    if len(distinct) >= 2:
        names = " and ".join(f"{s.name} ({', '.join(s.required)})" for s in distinct[:2])
        return None, (
            f"the row fits two shapes, {names} (fields: {fields}); drop or rename the other "
            "shape's fields (data.columns maps a file's names)"
        )
    return None, (
        f"the row fits no shape (its shape fields: {fields}); rows are text, input, "
        "prompt/completion, alpaca (instruction, output), messages or conversations; "
        "data.columns maps other names"
    )


# ---------------------------------------------------------------- reading a shape


def _str(row: dict[str, Any], name: str, optional: bool = False) -> str | None:
    value = row.get(name)
    if value is None and optional:
        return ""
    return value if isinstance(value, str) else None


def _read_text(row: dict[str, Any], shape: str) -> tuple[Example | None, str | None]:
    field = "text" if shape == "text" else "input"
    value = _str(row, field)
    if value is None:
        return None, f'"{field}" must be a string'
    return Example(text=value), None


def _read_prompt_completion(row: dict[str, Any], _: str) -> tuple[Example | None, str | None]:
    p, c = _str(row, "prompt"), _str(row, "completion")
    if p is None or c is None:
        return None, '"prompt" and "completion" must both be strings'
    return Example(
        messages=({"role": "user", "content": p}, {"role": "assistant", "content": c})
    ), None


def alpaca_prompt(instruction: str, input_: str, system: str) -> str:
    """The Alpaca project's own prompt (the text before the output), for a tokenizer with
    no chat template; a row's `system` takes the preamble's place."""
    preamble = system or ALPACA_PREAMBLE[0 if input_ else 1]
    parts = [preamble, f"### Instruction:\n{instruction}"]
    if input_:
        parts.append(f"### Input:\n{input_}")
    parts.append("### Response:\n")
    return "\n\n".join(parts)


def _read_alpaca(row: dict[str, Any], _: str) -> tuple[Example | None, str | None]:
    ins, out = _str(row, "instruction"), _str(row, "output")
    inp, system = _str(row, "input", True), _str(row, "system", True)
    if ins is None or out is None or inp is None or system is None:
        return None, '"instruction", "output" (and "input", "system" if given) must be strings'
    user = f"{ins}\n\n{inp}" if inp else ins
    msgs = ({"role": "system", "content": system},) if system else ()
    msgs += ({"role": "user", "content": user}, {"role": "assistant", "content": out})
    return Example(messages=msgs, fallback=(alpaca_prompt(ins, inp, system), out)), None


def _assistant_check(msgs: tuple[dict[str, Any], ...], field: str) -> str | None:
    if not any(m["role"] == "assistant" for m in msgs):
        return f'"{field}" has no assistant turn to learn from'
    return None


def _read_chat(row: dict[str, Any], shape: str) -> tuple[Example | None, str | None]:
    msgs = []
    for i, m in enumerate(row["messages"]):
        role, content = m.get("role"), m.get("content")
        calls = m.get("tool_calls")
        ok = isinstance(role, str) and (
            isinstance(content, str) or (content is None and calls and role == "assistant")
        )
        if not ok:
            return None, f'messages[{i}]: expected {{"role": str, "content": str}}'
        if calls is not None and not (isinstance(calls, list) and role == "assistant"):
            return None, f'messages[{i}]: "tool_calls" must be a list, on an assistant turn'
        msgs.append({k: v for k, v in m.items() if v is not None})
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        return None, '"tools" must be a list of tool (function) definitions'
    problem = _assistant_check(tuple(msgs), "messages")
    if problem:
        return None, problem
    return Example(messages=tuple(msgs), tools=tuple(tools) if tools else None), None


def _read_sharegpt(row: dict[str, Any], _: str) -> tuple[Example | None, str | None]:
    field = "conversations" if "conversations" in row else "messages"
    turns = row[field]
    if _messages_shape(turns, field) != "sharegpt":
        return None, f'"{field}" must be a non-empty list of {{"from", "value"}}'
    msgs: list[dict[str, Any]] = []
    system = _str(row, "system", True)
    if system is None:
        return None, '"system" must be a string'
    if system:
        msgs.append({"role": "system", "content": system})
    for i, t in enumerate(turns):
        role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
        if role is None:
            return None, (
                f"{field}[{i}]: unknown speaker {t['from']!r}; one of {', '.join(SHAREGPT_ROLES)}"
            )
        if not isinstance(t["value"], str):
            return None, f'{field}[{i}]: "value" must be a string'
        msgs.append({"role": role, "content": t["value"]})
    problem = _assistant_check(tuple(msgs), field)
    return (None, problem) if problem else (Example(messages=tuple(msgs)), None)


_READERS = {
    "text": _read_text,
    "input": _read_text,
    "prompt/completion": _read_prompt_completion,
    "alpaca": _read_alpaca,
    "chat": _read_chat,
    "tool use": _read_chat,
    "sharegpt": _read_sharegpt,
}
FAMILY = {"input": "text", "prompt/completion": "chat", "tool use": "chat"}
"""Shapes one source may mix, for they mean the same: text and the Ray template's input
(every token trained); prompt/completion, chat and tool use (a conversation rendered by
the chat template, its assistant turns trained). Alpaca and ShareGPT stand alone."""


class RowReader:
    """Reads one source's rows (their columns already mapped: `iter_parsed`), decides its
    shape from its first row, and holds every later row to it. The shape and the extra
    fields go to `report`."""

    def __init__(self, report: ScanReport | None = None):
        self.report = report if report is not None else ScanReport()
        self.family: str | None = None
        self.shapes: list[str] = []
        self._fits: dict[tuple[str, ...], str] = {}  # a corpus's rows share their fields

    def __call__(self, row: Any) -> tuple[Example | None, str | None]:
        if not isinstance(row, dict):
            return None, "expected a JSON object"
        keys = tuple(row)
        shape = self._fits.get(keys)
        if shape is None:
            shape, problem = fit(row)
            if shape is None:
                return None, problem
            if "messages" not in row and "conversations" not in row:
                self._fits[keys] = shape  # decided by the field names alone
        family = FAMILY.get(shape, shape)
        if self.family is not None and family != self.family:
            return None, (
                f"the row is {shape}, but this source's rows are {self.report.shape}; one shape "
                "a source (split the file into two sources of data.train_file)"
            )
        example, problem = _READERS[shape](row, shape)
        if example is None:
            return None, problem
        self.family = family
        if shape not in self.shapes:
            self.shapes.append(shape)
            self.report.shape = " + ".join(self.shapes)
        if len(row) > len(SHAPES[shape].required):  # extra fields, or optional ones
            extra = [k for k in row if k not in SHAPES[shape].fields]
            extra = [k for k in extra if k not in self.report.extra]
            if shape == "sharegpt" and "messages" in row:
                extra = [k for k in extra if k != "messages"]
            self.report.extra.extend(extra)
        return example, None


def describe(report: ScanReport, columns: Mapping[str, str] | None = None) -> str:
    """One line: the shape a source was read as, what is trained, the mapped and extra
    fields (validation, the plan, the run's first log lines and `raylift data` say it)."""
    if report.shape is None:
        return "no rows read"
    parts = report.shape.split(" + ")
    trained = "; ".join(SHAPES[s].trained if s in SHAPES else "the completions" for s in parts)
    out = f"read as {report.shape} (trained: {trained})"
    if columns:
        out += "; columns " + ", ".join(f"{t} ← {s}" for t, s in columns.items())
    if report.extra:
        out += "; extra fields ignored: " + ", ".join(report.extra)
    return out


def iter_examples(
    src: SourceFile,
    on_bad_line: str,
    report: ScanReport,
    endpoint: str | None = None,
    region: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Iterator[Example]:
    """Each row's Example, read as its source's one shape (see `iter_parsed` for bad rows)."""
    return iter_parsed(src, on_bad_line, report, RowReader(report), endpoint, region, columns)


def sample_check(
    spec: str, what: str, on_bad_line: str, limit: int, columns: Mapping[str, str] | None = None
) -> str | None:
    """The laptop's quick look: the first `limit` rows of the first local jsonl(.gz) file,
    read as their shape (a missing mapped column fails here, before launch). Returns a note:
    the shape found, or that the data can only be checked on the cluster (S3, zstd,
    parquet: those readers need pyarrow, which the laptop path does not import)."""
    if spec.startswith("s3://"):
        return f"{what} {spec}: S3 data is listed and checked on the cluster"
    files = list_local(spec)
    first = files[0]
    if first.fmt not in (".jsonl", ".jsonl.gz"):
        return f"{what} {first.uri}: {first.fmt} rows are checked on the cluster"
    scan = ScanReport()
    seen = 0
    for _ in iter_examples(first, on_bad_line, scan, columns=columns):
        seen += 1
        if seen >= limit:
            break
    if seen == 0 and scan.skipped == 0 and len(files) == 1:
        raise DataError(f"{what} {first.uri}: the file has no documents")
    return f"{what} {spec}: {describe(scan, columns)}"


def plan_notes(cfg: Any, limit: int = 200) -> list[str]:
    """The plan's lines on the data: the shape each local SFT source's first rows were read
    as (the same note validation prints), or why they could not be read, without failing
    the plan: a plan is asked for before the data is final too."""
    if cfg.train.objective != "sft":
        return []
    notes = []
    for which in ("train", "eval"):
        for spec in cfg.data.sources(which):
            what = f"data.{which}_file ({spec.name})"
            try:
                note = sample_check(
                    spec.path, what, cfg.data.on_bad_line, limit, cfg.data.columns_for(spec)
                )
            except UserError as exc:
                note = f"{what}: {exc}"
            if note:
                notes.append(note)
    return notes
