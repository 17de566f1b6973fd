"""Several corpora mixed by weight: which source, and which of its blocks, fills each slot
of a global batch.

Slot j of optimizer step s is drawn from source i with probability weight_i / Σ weights,
from a generator seeded by (seed, step), so the draw is a pure function of the step: the
same on every rank and whatever the number of workers (ranks slice the global batch the
way `BatchPlan` does), and a resumed run draws what the uninterrupted one drew. Each source
then hands out its blocks in its own permutations: its k-th draw takes position k mod N_i
of the permutation for its pass ⌊k / N_i⌋, seeded by (seed, source, pass); a heavily
weighted small source is repeated (a new order each pass) and a lightly weighted large one
is sampled down. An epoch is as many blocks as the sources hold together (Σ N_i / global
batch steps); the sources' own passes run on independently of it.

How far each source has got (k) is the count of its draws before the step, recomputed from
the draws themselves (a few microseconds a step) rather than stored: resume needs nothing
beyond the step counter, as with one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MIX = 0x6D6978  # a constant in the mix's seed, so its draws never equal another stream's


@dataclass
class MixPlan:
    sizes: list[int]
    weights: list[float]
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int
    _counts: tuple[int, np.ndarray] | None = field(default=None, repr=False)
    _orders: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return sum(self.sizes) // self.global_batch

    @property
    def probabilities(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()

    def draws(self, step: int) -> np.ndarray:
        """The source of every slot of the global batch at `step`."""
        rng = np.random.default_rng([self.seed, _MIX, step])
        return rng.choice(len(self.sizes), size=self.global_batch, p=self.probabilities)

    def counts_before(self, step: int) -> np.ndarray:
        """Blocks each source has given before `step` (cached for the next step)."""
        at, counts = self._counts or (0, np.zeros(len(self.sizes), dtype=np.int64))
        if step < at:
            at, counts = 0, np.zeros(len(self.sizes), dtype=np.int64)
        counts = counts.copy()
        k = len(self.sizes)
        for s in range(at, step):
            counts += np.bincount(self.draws(s), minlength=k)
        self._counts = (step, counts)
        return counts

    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.sizes):
                self._orders.clear()
            rng = np.random.default_rng([self.seed, _MIX, source, epoch])
            self._orders[key] = rng.permutation(self.sizes[source])
        return self._orders[key]

    def global_blocks(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, block) of every slot of the global batch at `step`."""
        src = self.draws(step)
        before = self.counts_before(step)
        blocks = np.empty(len(src), dtype=np.int64)
        for i in np.unique(src):
            slots = np.flatnonzero(src == i)
            k = before[i] + np.arange(len(slots))
            passes, positions = np.divmod(k, self.sizes[i])
            for e in np.unique(passes):
                here = passes == e
                blocks[slots[here]] = self._order(int(i), int(e))[positions[here]]
        return src, blocks

    def step_indices(self, step: int, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(sources, blocks) for rank `rank` at `step`, one pair per micro step: the same
        slicing of the global batch as BatchPlan's."""
        src, blocks = self.global_blocks(step)
        mb = self.micro_batch_size
        out = []
        for m in range(self.grad_accum):
            start = (m * self.world_size + rank) * mb
            out.append((src[start : start + mb], blocks[start : start + mb]))
        return out


class MixedBatches:
    """A rank's micro batches of a mix (the interface of `StepBatches`)."""

    def __init__(self, sources: list[Any], plan: MixPlan, rank: int):
        self.sources, self.plan, self.rank = sources, plan, rank

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, ...]]:
        out = []
        for src, blocks in self.plan.step_indices(step, self.rank):
            parts: list[np.ndarray] | None = None
            for i in np.unique(src):
                rows = np.flatnonzero(src == i)
                got = self.sources[int(i)].gather(blocks[rows])
                if parts is None:
                    parts = [np.empty((len(src), *g.shape[1:]), dtype=g.dtype) for g in got]
                for part, g in zip(parts, got, strict=True):
                    part[rows] = g
            assert parts is not None
            out.append(tuple(parts))
        return out
