"""Packed blocks out of the token cache, sampled by index.

Which blocks a worker reads at a given step is a pure function of (seed, epoch, step,
rank), so resume is exact and needs no loader state beyond the step counter; because the
order is defined over the *global* batch, resuming with a different number of workers
(same global batch) reads the same data.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.sources import load_special_tokens as load_special_tokens
from trainer.data.tokenize import IGNORE, TokenCache
from trainer.errors import DataError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- reading blocks


class _Files:
    """A few open file descriptors, least recently used closed first: a worker reading a
    corpus of thousands of shards keeps a bounded number open."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.fds: OrderedDict[Path, int] = OrderedDict()

    def pread(self, path: Path, nbytes: int, offset: int) -> bytes:
        fd = self.fds.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(self.fds) >= self.limit:
                os.close(self.fds.popitem(last=False)[1])
        self.fds[path] = fd
        data = os.pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise DataError(f"{path}: shorter than its manifest says; delete the cache folder")
        return data

    def __del__(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


class PackedBlocks:
    """Fixed-length blocks over the shards laid end to end: block i is tokens
    [i·B, (i+1)·B) of that stream, with its labels (-100 where the mask is 0).

    With `documents`, `gather` also returns each token's segment: the number of the
    document it belongs to, counted from 0 at the start of the block (a row split across
    blocks starts a new segment in the next block: its positions restart there). The first
    token of every document after the first is not a target: under document attention the
    token before it, the previous document's last, cannot see it coming.

    Blocks are read with pread, not through a memory map: the bytes pass through the page
    cache, which the kernel may drop, instead of staying mapped into this process, so a
    worker's resident memory stays flat however much of the corpus it has read."""

    def __init__(self, cache: TokenCache, block_size: int, documents: bool = False):
        meta = cache.meta
        self.dtype = np.dtype(meta["dtype"])
        shards = [s for s in meta["shards"] if s["tokens"]]
        d = cache.dir
        self.paths = [
            (d / f"{s['file']}.bin", d / f"{s['file']}.mask" if s["masked"] else None)
            for s in shards
        ]
        sizes = [s["tokens"] for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.block_size = block_size
        self.num_blocks = int(self.starts[-1]) // block_size
        self.files = _Files()
        self.documents = documents
        self.doc_paths = [d / f"{s['file']}.docs" for s in shards]
        if documents and meta.get("version", 0) < 3:
            raise DataError(f"{d}: a token cache without document ends; delete the folder")

    def __len__(self) -> int:
        return self.num_blocks

    def _read(
        self, start: int, ids_out: np.ndarray, labels_out: np.ndarray, segs_out: np.ndarray | None
    ) -> None:
        stop = start + len(ids_out)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        size = self.dtype.itemsize
        while pos < stop:
            ids_path, mask_path = self.paths[k]
            lo = pos - int(self.starts[k])
            n = min(stop, int(self.starts[k + 1])) - pos
            a = pos - start
            ids = np.frombuffer(self.files.pread(ids_path, n * size, lo * size), self.dtype)
            ids_out[a : a + n] = ids
            labels_out[a : a + n] = ids
            if mask_path is not None:
                mask = np.frombuffer(self.files.pread(mask_path, n, lo), np.uint8)
                labels_out[a : a + n][mask == 0] = IGNORE
            if segs_out is not None:
                segs_out[a : a + n] = k * (1 << 40) + self._doc_of(k, lo, n)
            pos += n
            k += 1

    def _doc_of(self, k: int, lo: int, n: int) -> np.ndarray:
        """The shard-local document number of tokens [lo, lo+n) of shard k."""
        path = self.doc_paths[k]
        count = path.stat().st_size // 8
        ends = np.memmap(path, dtype=np.int64, mode="r", shape=(count,))
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, lo + n - 1, side="right"))
        window = np.asarray(ends[first : last + 1])
        return first + np.searchsorted(window, np.arange(lo, lo + n), side="right")

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """(input ids, labels), each int64 of shape (len(indices), block_size); with
        `documents`, (input ids, labels, segments)."""
        b = self.block_size
        ids = np.empty((len(indices), b), dtype=np.int64)
        labels = np.empty((len(indices), b), dtype=np.int64)
        segs = np.empty((len(indices), b), dtype=np.int64) if self.documents else None
        for row, i in enumerate(indices):
            self._read(int(i) * b, ids[row], labels[row], None if segs is None else segs[row])
        if segs is None:
            return ids, labels
        starts = np.zeros_like(segs, dtype=bool)
        starts[:, 1:] = segs[:, 1:] != segs[:, :-1]
        labels[starts] = IGNORE
        segs = np.cumsum(starts, axis=1)
        return ids, labels, segs


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

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, ...]]:
        epoch = step // self.plan.steps_per_epoch
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.plan.order(epoch)
        return [
            self.blocks.gather(ix) for ix in self.plan.step_indices(step, self.rank, self._order)
        ]


def eval_indices(
    num_blocks: int, micro_batch_size: int, replicas: int, replica: int, limit: int | None
) -> list[np.ndarray]:
    """A replica's eval micro batches. The eval set is the first `limit` blocks (all of
    them with None) whatever the layout, strided across the data-parallel replicas. Every
    replica gets the same number of batches, since a sharded model's forward is a
    collective: the places past the set are -1, which the caller gathers as block 0 and
    leaves out of the loss."""
    chosen = num_blocks if limit is None else min(limit, num_blocks)
    per_replica = -(-chosen // replicas)
    mine = np.arange(replica, replica + per_replica * replicas, replicas)
    mine[mine >= chosen] = -1
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
