"""Data files the tests write: rows in any input format, and a chat template."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write(path: Path, rows: list, fmt: str | None = None) -> Path:
    """rows in jsonl, jsonl.gz, jsonl.zst or parquet, by the file's suffix. A str row is
    written as-is (a malformed line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = fmt or "".join(path.suffixes)
    if fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    body = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    if fmt == ".jsonl.gz":
        body = gzip.compress(body)
    elif fmt == ".jsonl.zst":
        import pyarrow as pa

        body = pa.Codec("zstd").compress(body, asbytes=True)
    path.write_bytes(body)
    return path
