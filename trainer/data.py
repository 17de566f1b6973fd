"""Data: JSONL → tokens once → a memory-mapped file → packed blocks, sampled by index.

The pipeline is nanoGPT-shaped on purpose. The corpus is tokenized once, streamed to a
flat token file next to the data (never held in RAM), and training reads fixed-length
blocks out of a memory map. Which blocks a worker reads at a given step is a pure
function of (seed, epoch, step, rank), so resume is exact and does not need any loader
state beyond the step counter; because the order is defined over the *global* batch,
resuming with a different number of workers (same global batch) reads the same data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Reading the JSONL lives in trainer.documents (numpy-free, for the laptop's preflight).
from trainer.documents import ScanReport, iter_documents
from trainer.errors import DataError, UserError

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_BATCH_DOCS = 2048


def file_fingerprint(path: Path) -> str:
    """Cheap identity of a possibly huge file: size, mtime and the bytes at both ends."""
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 1 << 20:
            f.seek(max(st.st_size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any, append_eos: bool) -> str:
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    h.update(f"|eos={tokenizer.eos_token_id}|append_eos={append_eos}|v{CACHE_VERSION}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TokenCache:
    """A tokenized file on disk: `tokens.bin` (flat ids) and `meta.json`."""

    dir: Path

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.dir / "meta.json").read_text())

    def tokens(self) -> np.memmap:
        meta = self.meta
        return np.memmap(
            self.dir / "tokens.bin",
            dtype=np.dtype(meta["dtype"]),
            mode="r",
            shape=(meta["num_tokens"],),
        )


def cache_dir_for(data_file: Path, cache_root: str | None, tok_fp: str) -> Path:
    root = Path(cache_root) if cache_root else data_file.parent / ".raylift-cache"
    return root / f"{data_file.name}-{file_fingerprint(data_file)}-{tok_fp}"


def prepare(
    data_file: str | Path,
    tokenizer: Any,
    *,
    append_eos: bool = True,
    on_bad_line: str = "error",
    cache_root: str | None = None,
    progress: bool = True,
) -> TokenCache:
    """Tokenize `data_file` into a cache (or reuse a finished one). Streams: peak memory is
    one batch of documents, whatever the corpus size. The cache appears atomically."""
    path = Path(data_file)
    if str(data_file).startswith("s3://"):
        raise UserError(
            f"{data_file}: data files are read from a local or shared-FS path (e.g. EFS); "
            "copy the JSONL there"
        )
    if not path.is_file():
        raise UserError(f"{path}: data file not found")
    if append_eos and tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token; add one or set data.append_eos: false")
    out = cache_dir_for(path, cache_root, tokenizer_fingerprint(tokenizer, append_eos))
    if (out / "meta.json").exists():
        log.info("using tokenized cache %s", out)
        return TokenCache(out)

    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    report = ScanReport()
    total = path.stat().st_size
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    num_tokens = 0
    bar = _progress(total, f"tokenizing {path.name}", progress)
    try:
        with open(tmp / "tokens.bin", "wb") as sink:
            batch: list[str] = []
            docs = iter_documents(path, on_bad_line, report)
            consumed = 0
            for text in docs:
                batch.append(text)
                if len(batch) == _BATCH_DOCS:
                    num_tokens += _encode_into(
                        backend, batch, eos if append_eos else None, dtype, sink
                    )
                    consumed += sum(len(t) for t in batch)
                    bar.update(min(consumed, total) - bar.n)
                    batch = []
            if batch:
                num_tokens += _encode_into(backend, batch, eos if append_eos else None, dtype, sink)
        bar.update(total - bar.n)
        bar.close()
        if report.documents == 0:
            raise DataError(f"{path}: no usable documents (skipped {report.skipped} lines)")
        meta = {
            "version": CACHE_VERSION,
            "source": str(path.resolve()),
            "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens,
            "documents": report.documents,
            "skipped_lines": report.skipped,
            "first_skipped": report.first_skipped,
            "vocab_size": vocab,
            "eos_token_id": eos,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.replace(tmp, out)
        except OSError:
            # Someone else finished the same cache first; theirs is equally valid.
            if not (out / "meta.json").exists():
                raise
    finally:
        if tmp.exists():
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()
    if report.skipped:
        log.warning(
            "%s: skipped %d malformed lines (first: %s)",
            path,
            report.skipped,
            "; ".join(report.first_skipped),
        )
    log.info("tokenized %s: %d documents, %d tokens → %s", path, report.documents, num_tokens, out)
    return TokenCache(out)


def _encode_into(backend: Any, texts: list[str], eos: int | None, dtype: Any, sink: Any) -> int:
    encodings = backend.encode_batch_fast(texts, add_special_tokens=True)
    chunks = []
    for enc in encodings:
        ids = enc.ids
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        chunks.append(np.asarray(ids, dtype=dtype))
    flat = np.concatenate(chunks) if chunks else np.empty(0, dtype=dtype)
    sink.write(flat.tobytes())
    return int(flat.size)


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


class PackedBlocks:
    """Fixed-length blocks over a token cache: block i is tokens[i*B:(i+1)*B]."""

    def __init__(self, cache: TokenCache, block_size: int):
        self.tokens = cache.tokens()
        self.block_size = block_size
        self.num_blocks = len(self.tokens) // block_size

    def __len__(self) -> int:
        return self.num_blocks

    def gather(self, indices: np.ndarray) -> np.ndarray:
        b = self.block_size
        out = np.empty((len(indices), b), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self.tokens[int(i) * b : (int(i) + 1) * b]
        return out


@dataclass(frozen=True)
class BatchPlan:
    """Which blocks each rank reads for each micro step.

    Epoch e visits the blocks in the permutation drawn from (seed, e). Optimizer step s
    of that epoch takes the global-batch slice [s·G, (s+1)·G) of it; micro step m of rank r
    takes its own contiguous run inside that slice. The tail that doesn't fill a global
    batch is skipped that epoch (a different tail each epoch, since the order changes).
    """

    num_blocks: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)

    def step_indices(
        self, step: int, rank: int, order: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """Block indices for rank `rank` at 0-based global optimizer step `step`, one array
        per micro step."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = self.order(epoch) if order is None else order
        base = in_epoch * self.global_batch
        mb = self.micro_batch_size
        out = []
        for m in range(self.grad_accum):
            start = base + (m * self.world_size + rank) * mb
            out.append(order[start : start + mb])
        return out


class StepBatches:
    """Iterates a rank's micro batches from a given step on; caches the epoch order."""

    def __init__(self, blocks: PackedBlocks, plan: BatchPlan, rank: int):
        self.blocks, self.plan, self.rank = blocks, plan, rank
        self._epoch = -1
        self._order: np.ndarray | None = None

    def micro_batches(self, step: int) -> list[np.ndarray]:
        epoch = step // self.plan.steps_per_epoch
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.plan.order(epoch)
        return [
            self.blocks.gather(ix) for ix in self.plan.step_indices(step, self.rank, self._order)
        ]


def eval_indices(
    num_blocks: int, micro_batch_size: int, world_size: int, rank: int, max_batches: int | None
) -> list[np.ndarray]:
    """A rank's eval micro batches: blocks strided across ranks, in file order."""
    mine = np.arange(rank, num_blocks, world_size)
    if max_batches is not None:
        mine = mine[: max_batches * micro_batch_size]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
