"""Rows → tokens once → sharded memory-mapped files: the cache key, the shards and the
token cache (`prepare`). What a row means is `trainer.data.shapes`, how it becomes ids and
a loss mask `trainer.data.encode`.

The pipeline is nanoGPT-shaped on purpose. Each input file is tokenized once into its own
shard of flat token ids (plus, for instruction and chat rows, a parallel byte per token that
says whether the token is in the loss), streamed to disk and never held in RAM; training
reads fixed-length blocks out of memory maps (`trainer.data.blocks`). The shards are laid
end to end in the sorted order of the input files, so the token stream, and with it every
block, is the same whoever tokenized which file (one process here, or Ray Data tasks across
the cluster: `trainer.data.cluster`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.encode import CACHE_VERSION, Encoder, Settings
from trainer.data.encode import read_chat_template as read_chat_template
from trainer.data.shapes import iter_examples
from trainer.data.sources import Example, ScanReport, SourceFile, list_sources
from trainer.data.sources import load_special_tokens as load_special_tokens
from trainer.data.tokenizer_files import ShippedTokenizer as ShippedTokenizer
from trainer.data.tokenizer_files import TokenizerFiles, tokenizer_fingerprint
from trainer.errors import DataError, UserError

log = logging.getLogger(__name__)


IGNORE = -100  # the label Hugging Face's loss skips
_BATCH_DOCS = 2048
_BATCH_CHARS = 1 << 20
"""A batch of rows is encoded at once: at most 2048 rows and about 1M characters, so the
memory in flight (two batches: one encoding while the next is read) is bounded by the
text, whether a corpus has short rows or whole books, and not by the size of its files."""


# ---------------------------------------------------------------- the cache key


def source_fingerprint(src: SourceFile) -> str:
    """Cheap identity of a possibly huge file: path, size, mtime, and for local files the
    bytes at both ends. S3 objects are identified by key, size and mtime (reading them
    again would be the very cost the cache saves)."""
    h = hashlib.sha256(f"{src.uri}|{src.size}|{src.mtime_ns}".encode())
    if not src.is_s3:
        with open(src.uri, "rb") as f:
            h.update(f.read(1 << 20))
            if src.size > 1 << 20:
                f.seek(max(src.size - (1 << 20), 0))
                h.update(f.read(1 << 20))
    return h.hexdigest()


def cache_key(sources: list[SourceFile], tokenizer: Any, settings: Settings) -> str:
    h = hashlib.sha256(tokenizer_fingerprint(tokenizer).encode())
    h.update(settings.key().encode())
    for src in sources:
        h.update(source_fingerprint(src).encode())
    return h.hexdigest()[:16]


def cache_dir_for(spec: str, sources: list[SourceFile], cache_root: str | None, key: str) -> Path:
    if cache_root:
        root = Path(cache_root).expanduser()
    elif spec.startswith("s3://"):
        raise UserError(f"{spec}: S3 data needs data.cache_dir, a shared-FS folder every node sees")
    else:
        root = Path(sources[0].uri).parent / ".raylift-cache"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.rstrip("/").rsplit("/", 1)[-1]) or "data"
    return root / f"{name}-{key}"


# ---------------------------------------------------------------- shards


@dataclass
class ShardStats:
    file: str  # the shard's file stem inside the cache folder
    source: str
    tokens: int = 0
    masked: bool = False
    documents: int = 0
    chats: int = 0  # rows rendered as a conversation (chat, prompt/completion)
    skipped: int = 0
    first_skipped: list[str] = field(default_factory=list)
    long_rows: int = 0
    dropped_rows: int = 0
    node: str = ""  # the Ray node that wrote it (cluster tokenizing)
    shape: str | None = None  # the rows' shape (trainer.data.shapes)
    extra: list[str] = field(default_factory=list)  # fields no shape reads
    trained: int = 0  # tokens in the loss


def token_dtype(tokenizer: Any) -> Any:
    return np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32


def tokenize_file(
    src: SourceFile,
    stem: str,
    folder: Path,
    tokenizer: Any,
    settings: Settings,
    on_bytes: Callable[[int], None] | None = None,
    overlap: bool = True,
) -> ShardStats:
    """Tokenize one input file into `<stem>.bin` (+ `<stem>.mask` if any token is out of
    the loss) in `folder`. Raises DataError with file:line.

    With `overlap`, reading and parsing rows (Python, holding the GIL) overlaps with
    encoding the batch before (the Rust tokenizer releases the GIL and uses every core):
    one batch is encoded in a helper thread while the next is read, so memory stays at two
    batches of rows. Without it (a cluster task that was given one CPU) every step runs in
    the calling thread."""
    enc = Encoder(tokenizer, settings)
    writer = _ShardWriter(folder, stem, token_dtype(tokenizer), settings, src.uri)
    report = ScanReport()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        pending: tuple[int, Future] | None = None  # (its characters, its encoding)

        def hand_over(batch: list[Example], chars: int) -> None:
            nonlocal pending
            if pending is not None:
                done_chars, encoded = pending
                writer.add(encoded.result())
                if on_bytes is not None:
                    on_bytes(done_chars)
            pending = (chars, encode(batch)) if batch else None

        def encode(batch: list[Example]) -> Future:
            if overlap:
                return pool.submit(enc.encode, batch)
            done: Future = Future()
            done.set_result(enc.encode(batch))
            return done

        batch: list[Example] = []
        chars = chats = 0
        try:
            for example in iter_examples(
                src,
                settings.on_bad_line,
                report,
                settings.endpoint,
                settings.region,
                dict(settings.columns),
            ):
                batch.append(example)
                chars += _chars(example)
                chats += example.text is None
                if len(batch) == _BATCH_DOCS or chars >= _BATCH_CHARS:
                    hand_over(batch, chars)
                    batch, chars = [], 0
            hand_over(batch, chars)
            hand_over([], 0)
        finally:
            if pending is not None:
                pending[1].cancel()
            writer.close()
    stats = writer.stats
    stats.documents, stats.skipped, stats.chats = report.documents, report.skipped, chats
    stats.first_skipped, stats.shape, stats.extra = report.first_skipped, report.shape, report.extra
    return stats


def _chars(example: Example) -> int:
    return len(example.text or "") + sum(len(str(m.get("content") or "")) for m in example.messages)


class _ShardWriter:
    """Appends encoded rows to a shard's `.bin` (and `.mask`, once a row is masked), and
    each row's end offset in the shard to its `.docs` (int64): where documents begin is
    what document attention needs, and 8 bytes per row is cheap beside the row's tokens."""

    def __init__(self, folder: Path, stem: str, dtype: Any, settings: Settings, source: str):
        self.dtype, self.settings = dtype, settings
        self.stats = ShardStats(file=stem, source=source)
        self.mask_path = folder / f"{stem}.mask"
        self.ids_out = open(folder / f"{stem}.bin", "wb")  # noqa: SIM115 (closed in close())
        self.mask_out = open(self.mask_path, "wb")  # noqa: SIM115
        self.docs_out = open(folder / f"{stem}.docs", "wb")  # noqa: SIM115

    def add(self, encoded: list[tuple[list[int], np.ndarray | None]]) -> None:
        stats, settings, dtype = self.stats, self.settings, self.dtype
        kept = []
        for ids, mask in encoded:
            if len(ids) > settings.block_size:
                stats.long_rows += 1
                if settings.long_rows == "drop":
                    stats.dropped_rows += 1
                    continue
            kept.append((ids, mask))
        if not kept:
            return  # every row of the batch was dropped
        ends = stats.tokens + np.cumsum([len(ids) for ids, _ in kept], dtype=np.int64)
        self.docs_out.write(ends.tobytes())
        if not stats.masked and all(m is None for _, m in kept):
            # Text only so far: no mask file (a pretraining corpus never pays for one).
            flat = np.concatenate([np.asarray(ids, dtype=dtype) for ids, _ in kept])
            self.ids_out.write(flat.tobytes())
            stats.tokens += int(flat.size)
            stats.trained += int(flat.size)
            return
        if not stats.masked:  # the first masked row: everything before is in the loss
            stats.masked = True
            for done in range(0, stats.tokens, 1 << 24):
                self.mask_out.write(b"\x01" * min(1 << 24, stats.tokens - done))
        masks = [np.ones(len(i), np.uint8) if m is None else m for i, m in kept]
        flat = np.concatenate([np.asarray(ids, dtype=dtype) for ids, _ in kept])
        self.ids_out.write(flat.tobytes())
        joined = np.concatenate(masks)
        self.mask_out.write(joined.tobytes())
        stats.tokens += int(flat.size)
        stats.trained += int(joined.sum())

    def close(self) -> None:
        self.ids_out.close()
        self.mask_out.close()
        self.docs_out.close()
        if not self.stats.masked:
            self.mask_path.unlink(missing_ok=True)


# ---------------------------------------------------------------- the cache


@dataclass(frozen=True)
class TokenCache:
    """A tokenized corpus on disk: `manifest.json` and one `shard-NNNNN.bin` (flat ids,
    with a `.mask` of 0/1 loss bytes beside it when some tokens are masked) per input."""

    dir: Path

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.dir / "manifest.json").read_text())

    def shards(self) -> list[tuple[np.memmap, np.memmap | None]]:
        meta = self.meta
        dtype = np.dtype(meta["dtype"])
        out = []
        for shard in meta["shards"]:
            if shard["tokens"] == 0:
                continue
            ids = np.memmap(
                self.dir / f"{shard['file']}.bin", dtype=dtype, mode="r", shape=(shard["tokens"],)
            )
            mask = None
            if shard["masked"]:
                mask = np.memmap(
                    self.dir / f"{shard['file']}.mask",
                    dtype=np.uint8,
                    mode="r",
                    shape=(shard["tokens"],),
                )
            out.append((ids, mask))
        return out

    def tokens(self) -> np.ndarray:
        """The whole token stream in one array: for tests and small corpora only."""
        parts = [ids for ids, _ in self.shards()]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _finish(tmp: Path, out: Path, meta: dict[str, Any]) -> TokenCache:
    (tmp / "manifest.json").write_text(json.dumps(meta, indent=2))
    try:
        os.replace(tmp, out)
    except OSError:
        # Someone else finished the same cache first; theirs is equally valid.
        if not (out / "manifest.json").exists():
            raise
    return TokenCache(out)


def summarize(sources: list[SourceFile], stats: list[ShardStats], dtype: Any) -> dict[str, Any]:
    first_skipped = [s for st in stats for s in st.first_skipped][:5]
    return {
        "version": CACHE_VERSION,
        "sources": [s.uri for s in sources],
        "dtype": np.dtype(dtype).name,
        "num_tokens": sum(s.tokens for s in stats),
        "trained_tokens": sum(s.trained for s in stats),
        "documents": sum(s.documents for s in stats),
        "chat_documents": sum(s.chats for s in stats),
        "skipped_lines": sum(s.skipped for s in stats),
        "first_skipped": first_skipped,
        "long_rows": sum(s.long_rows for s in stats),
        "dropped_rows": sum(s.dropped_rows for s in stats),
        "shards": [
            {
                "file": s.file,
                "source": s.source,
                "tokens": s.tokens,
                "masked": s.masked,
                "node": s.node,
                "documents": s.documents,
                "trained": s.trained,
                "long_rows": s.long_rows,
                "dropped_rows": s.dropped_rows,
                "shape": s.shape,
                "extra": s.extra,
            }
            for s in stats
        ],
    }


def _report(spec: str, meta: dict[str, Any], settings: Settings, out: Path) -> None:
    if meta["skipped_lines"]:
        log.warning(
            "%s: skipped %d malformed rows (first: %s)",
            spec,
            meta["skipped_lines"],
            "; ".join(meta["first_skipped"]),
        )
    if meta["long_rows"]:
        verb = "dropped" if settings.long_rows == "drop" else "split across blocks"
        verb += " (data.long_rows)"
        if hasattr(settings, "max_prompt_tokens"):  # a pair cache never splits a pair
            verb = "cut to fit, the prompt from the left first (train.preference)"
        log.warning(
            "%s: %d rows are longer than a block of %d tokens: %s",
            spec,
            meta["long_rows"],
            settings.block_size,
            verb,
        )
    _log_shapes(spec, meta, settings)
    log.info(
        "tokenized %s: %d files, %d documents, %d tokens → %s",
        spec,
        len(meta["shards"]),
        meta["documents"],
        meta["num_tokens"],
        out,
    )


def _log_shapes(spec: str, meta: dict[str, Any], settings: Settings) -> None:
    """Which shape the files were read as: among the run's first log lines, cache hit or not."""
    for shape in sorted({s["shape"] for s in meta["shards"] if s.get("shape")}):
        files = [s for s in meta["shards"] if s.get("shape") == shape]
        extra = sorted({f for s in files for f in s.get("extra") or []})
        log.info(
            "%s: %d files read as %s%s%s",
            spec,
            len(files),
            shape,
            f" (columns {dict(settings.columns)})" if settings.columns else "",
            f"; extra fields ignored: {', '.join(extra)}" if extra else "",
        )


def prepare(
    data: str | Path,
    tokenizer: Any,
    *,
    append_eos: bool = True,
    on_bad_line: str = "error",
    cache_root: str | None = None,
    progress: bool = True,
    settings: Settings | None = None,
    tokenize_shards: Callable[..., list[ShardStats]] | None = None,
    columns: dict[str, str] | None = None,
) -> TokenCache:
    """Tokenize the files `data` names (a file, folder, glob or s3:// prefix) into a cache,
    or reuse a finished one. The cache appears atomically. `tokenize_shards` swaps the
    local loop for another engine (trainer.data.cluster: Ray Data across the cluster).
    `columns` maps the files' column names to a shape's fields (data.columns)."""
    spec = str(data)
    settings = settings or Settings(append_eos=append_eos, on_bad_line=on_bad_line)
    if columns:  # this source's data.columns
        settings = dataclasses.replace(settings, columns=tuple(sorted(columns.items())))
    sources = list_sources(spec, settings.endpoint, settings.region)
    out = cache_dir_for(spec, sources, cache_root, cache_key(sources, tokenizer, settings))
    if (out / "manifest.json").exists():
        log.info("using tokenized cache %s", out)
        cache = TokenCache(out)
        _log_shapes(spec, cache.meta, settings)
        return cache
    if isinstance(tokenizer, TokenizerFiles):
        tokenizer = tokenizer.load()
    if settings.append_eos and tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token; add one or set data.append_eos: false")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        engine = tokenize_shards or tokenize_local
        stats = engine(sources, tmp, tokenizer, settings, progress)
        meta = summarize(sources, stats, token_dtype(tokenizer))
        if meta["documents"] == 0:
            raise DataError(f"{spec}: no usable documents (skipped {meta['skipped_lines']} rows)")
        cache = _finish(tmp, out, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(spec, meta, settings, out)
    return cache


def tokenize_local(
    sources: list[SourceFile], folder: Path, tokenizer: Any, settings: Settings, progress: bool
) -> list[ShardStats]:
    """Every file in this process, one after the other (the engine without Ray)."""
    bar = _progress(sum(s.size for s in sources), "tokenizing", progress)
    stats = []
    for i, src in enumerate(sources):
        end = bar.n + src.size

        def advance(chars: int, end: int = end) -> None:
            # Text characters stand in for file bytes (compressed files read more of
            # them); the bar never passes the end of the current file.
            bar.update(max(min(bar.n + chars, end) - bar.n, 0))

        stats.append(tokenize_file(src, f"shard-{i:05d}", folder, tokenizer, settings, advance))
        bar.update(end - bar.n)
    bar.close()
    return stats


class _NullBar:
    n = 0

    def update(self, k: int) -> None:
        self.n += k

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NullBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, mininterval=2.0)
