"""`data:` the sources, how rows become blocks, and where the token caches go."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.base import _Section
from trainer.config.shapes import check_column_targets

_COLUMNS = (
    "The file's column names for a shape's fields, {field: column} (e.g. {prompt: question, "
    "completion: answer}, {chosen: response_j, rejected: response_k})"
)


def _check_columns(value: dict[str, str] | None) -> dict[str, str] | None:
    if value:
        check_column_targets(value)
    return value


class SourceSpec(_Section):
    """One corpus of a mix: its files, its share of the blocks, and its name in metrics."""

    path: str = Field(description="A file, folder, glob or s3:// prefix (as data.train_file).")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the blocks drawn.")
    name: str | None = Field(
        default=None, description="Name in metrics (tokens_seen/<name>, eval_loss/<name>)."
    )
    columns: dict[str, str] | None = Field(
        default=None, description=_COLUMNS + " for this source; null = data.columns."
    )

    @field_validator("columns")
    @classmethod
    def _column_targets(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _check_columns(value)


def _source_name(spec: SourceSpec) -> str:
    if spec.name:
        return spec.name
    for part in reversed(spec.path.rstrip("/").split("/")):
        name = re.sub(r"(\.jsonl|\.gz|\.zst|\.parquet)+$", "", part)
        if name and not any(c in name for c in "*?["):
            return name
    return "data"


def _spec(value: str | SourceSpec) -> SourceSpec:
    return SourceSpec(path=value) if isinstance(value, str) else value


class DataSection(_Section):
    train_file: str | list[str | SourceSpec] = Field(
        description="A file, folder, glob or s3:// prefix of .jsonl, .jsonl.gz, .jsonl.zst or "
        '.parquet files; rows are {"text"}, {"input"} (alone), {"prompt", "completion"}, '
        'Alpaca {"instruction", "input", "output"}, {"messages": [{"role", "content"}, ...]} '
        '(tool calls and a "tools" column too) or ShareGPT {"conversations": [{"from", '
        '"value"}]}, one shape per source (docs/data.md). Files are read in sorted path order. '
        "Or a list of such sources, each a path or {path, weight, name, columns}: every block of a "
        "global batch is drawn from source i with probability weight_i / sum of weights."
    )
    eval_file: str | list[str | SourceSpec] | None = Field(
        default=None,
        description="The same kinds of input, for eval loss/perplexity; a list gives an "
        "eval_loss/<name> per source besides the overall eval_loss.",
    )
    block_size: int = Field(default=1024, gt=1, description="Tokens per packed sequence.")
    on_bad_line: Literal["error", "skip"] = Field(
        default="error",
        description="error: stop at the first malformed row (file:line, or file:row N for "
        "parquet). skip: skip it, count it, and report the count and first rows.",
    )
    append_eos: bool = Field(
        default=True, description="End every document with EOS (kept in the loss)."
    )
    loss_on: Literal["all", "completion"] = Field(
        default="completion",
        description="completion: prompt/completion and chat rows are trained on the completion "
        "and assistant tokens only (text rows: every token). all: every token of every row.",
    )
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template (a file path or the text) for prompt/completion and "
        "chat rows; null = the tokenizer's own.",
    )
    columns: dict[str, str] | None = Field(
        default=None,
        description=_COLUMNS + ", for every source without columns of its own. A missing "
        "column is an error at the row (the laptop's validation reads the first rows).",
    )

    @field_validator("columns")
    @classmethod
    def _column_targets(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _check_columns(value)

    def columns_for(self, source: SourceSpec) -> dict[str, str]:
        """A source's column mapping: its own, else data.columns."""
        return dict(source.columns if source.columns is not None else self.columns or {})

    @field_validator("train_file", "eval_file")
    @classmethod
    def _sources_named_once(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list of sources; give at least one path")
            names = [_source_name(_spec(v)) for v in value]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"sources named {', '.join(twice)} more than once; give each a unique name"
                )
        return value

    def sources(self, which: str = "train") -> list[SourceSpec]:
        """The train (or eval) sources, each with its name: a single path is one source."""
        value = self.train_file if which == "train" else self.eval_file
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        return [_spec(v).model_copy(update={"name": _source_name(_spec(v))}) for v in items]

    long_rows: Literal["split", "drop"] = Field(
        default="split",
        description="Rows longer than block_size: split across blocks, or drop them; the count "
        "is reported either way.",
    )
    attention: Literal["auto", "document", "causal"] = Field(
        default="auto",
        description="document: a token attends only to earlier tokens of its own row, and "
        "positions restart per row (a block-causal mask: packed rows stay independent). "
        "causal: every earlier token of the packed block. auto: document when the data has "
        "chat or prompt/completion rows, causal for plain text (and under strategy.pp > 1).",
    )
    tokenize_on: Literal["auto", "driver", "cluster"] = Field(
        default="auto",
        description="cluster: Ray Data tasks on every node's CPUs, one per input file. driver: "
        "one process where the job starts. auto: cluster for several files on a Ray cluster.",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Where tokenized caches go (a shared-FS folder every node mounts); default "
        "is next to local data. Required for s3:// data.",
    )
