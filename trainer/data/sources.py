"""Where the data rows come from: files, folders, globs and s3:// prefixes, in jsonl,
jsonl.gz, jsonl.zst or parquet. What each row means is `trainer.data.shapes`.

This module imports only the standard library at the top, because the laptop's
preflight samples local jsonl(.gz) files through it. pyarrow is imported inside the
functions that need it (S3, zstd, parquet), which only run on the cluster.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import DataError, UserError
from trainer.model.tokens import load_special_tokens as load_special_tokens  # callers' name

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
_GLOB = set("*?[")


@dataclass(frozen=True)
class SourceFile:
    """One input file, and the cheap facts that identify its content (the cache key)."""

    uri: str  # what errors print: a local path or s3://bucket/key
    size: int
    mtime_ns: int

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def fmt(self) -> str:
        for suffix in SUFFIXES:
            if self.uri.endswith(suffix):
                return suffix
        return ".jsonl"


@dataclass(frozen=True)
class Example:
    """A row's meaning: plain text (every token in the loss), or chat messages as a chat
    template takes them (dicts with role and content, and tool_calls), where only the
    assistant turns are completions; `tools` goes to the template beside them.
    `fallback` is (prompt, completion) as plain text, for a tokenizer without a chat
    template (an Alpaca row under the Alpaca project's own prompt)."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    fallback: tuple[str, str] | None = None


@dataclass
class ScanReport:
    documents: int = 0
    skipped: int = 0
    first_skipped: list[str] = field(default_factory=list)
    shape: str | None = None  # the shape the source's rows were read as (trainer.data.shapes)
    extra: list[str] = field(default_factory=list)  # fields no shape reads, listed once


def _supported(name: str) -> bool:
    return name.endswith(SUFFIXES)


def _has_glob(uri: str) -> bool:
    return any(c in _GLOB for c in uri)


def list_local(spec: str) -> list[SourceFile]:
    """A file, a folder (every supported file under it) or a glob, sorted by path so the
    global order of rows does not depend on the filesystem's listing order."""
    path = Path(spec).expanduser()
    if _has_glob(spec):
        names = [p for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    elif path.is_dir():
        names = [str(p) for p in path.rglob("*") if p.is_file() and _supported(p.name)]
        names = [n for n in names if "/.raylift-cache/" not in n]
    elif path.is_file():
        names = [str(path)]
    else:
        raise UserError(f"{spec}: data not found (a file, folder, glob or s3:// prefix)")
    out = []
    for name in sorted(names):
        st = os.stat(name)
        out.append(SourceFile(str(Path(name).resolve()), st.st_size, st.st_mtime_ns))
    if not out:
        raise UserError(f"{spec}: no data files ({', '.join(SUFFIXES)}) found there")
    return out


def list_s3(spec: str, endpoint: str | None, region: str | None) -> list[SourceFile]:
    """An object, a prefix (every supported object under it) or a glob over keys."""
    import fnmatch

    import pyarrow.fs as pafs

    from trainer.storage.location import resolve

    loc = resolve(spec, endpoint, region)
    pattern = loc.path if _has_glob(loc.path) else None
    base = loc.path
    if pattern is not None:
        cut = min(i for i, c in enumerate(pattern) if c in _GLOB)
        base = pattern[:cut].rsplit("/", 1)[0]
    try:
        info = loc.fs.get_file_info(base)
        if info.type == pafs.FileType.File and pattern is None:
            infos = [info]
        elif info.type == pafs.FileType.NotFound:
            infos = []
        else:
            sel = pafs.FileSelector(base, recursive=True)
            infos = [i for i in loc.fs.get_file_info(sel) if i.type == pafs.FileType.File]
    except OSError as exc:
        raise UserError(f"{spec}: cannot list: {str(exc).splitlines()[0][:300]}") from None
    if pattern is not None:
        infos = [i for i in infos if fnmatch.fnmatchcase(i.path, pattern)]
    else:
        infos = [i for i in infos if _supported(i.path)]
    out = [
        SourceFile("s3://" + i.path, int(i.size or 0), int(i.mtime_ns or 0))
        for i in sorted(infos, key=lambda i: i.path)
    ]
    if not out:
        raise UserError(f"{spec}: no data files ({', '.join(SUFFIXES)}) found there")
    return out


def list_sources(
    spec: str, endpoint: str | None = None, region: str | None = None
) -> list[SourceFile]:
    if spec.startswith("s3://"):
        return list_s3(spec, endpoint, region)
    return list_local(spec)


def _open_binary(src: SourceFile, endpoint: str | None, region: str | None) -> Any:
    """A binary line stream over the decompressed bytes of a jsonl file."""
    if not src.is_s3 and src.fmt in (".jsonl", ".jsonl.gz"):
        return gzip.open(src.uri, "rb") if src.fmt == ".jsonl.gz" else open(src.uri, "rb")
    import io

    from trainer.storage.location import resolve

    loc = resolve(src.uri, endpoint, region)
    try:
        stream = loc.fs.open_input_stream(loc.path, compression="detect")
    except OSError as exc:
        raise UserError(f"{src.uri}: cannot read: {str(exc).splitlines()[0][:300]}") from None
    return io.BufferedReader(stream, buffer_size=1 << 20)


def iter_raw(
    src: SourceFile, endpoint: str | None = None, region: str | None = None
) -> Iterator[tuple[int, Any, str | None]]:
    """(line or row number, parsed object, problem) for every non-blank row."""
    if src.fmt == ".parquet":
        yield from _iter_parquet(src, endpoint, region)
        return
    with _open_binary(src, endpoint, region) as f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise DataError(
                    f"{src.uri}:{lineno + 1}: cannot decompress ({exc}); is the file whole?"
                ) from None
            if not raw:
                return
            lineno += 1
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw), None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield lineno, None, f"not valid JSON ({getattr(exc, 'msg', exc)})"


def _iter_parquet(
    src: SourceFile, endpoint: str | None, region: str | None
) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    from trainer.storage.location import resolve

    loc = resolve(src.uri, endpoint, region)
    try:
        pf = pq.ParquetFile(loc.fs.open_input_file(loc.path))
    except Exception as exc:
        raise DataError(f"{src.uri}: not a readable parquet file ({exc})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            row += 1
            yield row, obj, None


def apply_columns(obj: Any, columns: Mapping[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """The row with the file's column names renamed to shape fields by `columns`
    ({field: column}), or why not: a missing column. An unmapped column that has a mapped
    field's name is dropped (the mapping says which column that field is). `iter_parsed`
    applies it, once, before any reader sees the row (SFT shapes, preference and KTO rows)."""
    if not isinstance(obj, dict):
        return None, "expected a JSON object"
    if not columns:
        return obj, None
    missing = [f"{src!r} (for {tgt})" for tgt, src in columns.items() if src not in obj]
    if missing:
        return None, (
            f"missing column {', '.join(missing)}; data.columns maps it: fix the mapping or the row"
        )
    taken = set(columns.values())
    out = {k: v for k, v in obj.items() if k not in taken and k not in columns}
    for target, source in columns.items():
        out[target] = obj[source]
    return out, None


def iter_parsed(
    src: SourceFile,
    on_bad_line: str,
    report: ScanReport,
    parse: Callable[[Any], tuple[Any, str | None]],
    endpoint: str | None = None,
    region: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """Each row as `parse` reads it (an SFT Example, a preference Pair) after `columns`
    (data.columns) renames its fields; a bad row raises DataError naming file:line
    (file:row for parquet), or, with on_bad_line=skip, is counted in `report`, never
    dropped silently."""
    unit = "row " if src.fmt == ".parquet" else ""
    for lineno, obj, problem in iter_raw(src, endpoint, region):
        item = None
        if problem is None and columns:
            obj, problem = apply_columns(obj, columns)
        if problem is None:
            item, problem = parse(obj)
        if item is None:
            where = f"{src.uri}:{unit}{lineno}"
            if on_bad_line == "error":
                raise DataError(f"{where}: {problem}; fix the row or set data.on_bad_line: skip")
            report.skipped += 1
            if len(report.first_skipped) < 5:
                report.first_skipped.append(f"{where}: {problem}")
            continue
        report.documents += 1
        yield item
