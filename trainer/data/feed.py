"""The training data as the loop sees it: one interface whether the run reads one source
or a weighted mix of several (`trainer.data.mixing`), so the loop never asks which.

A feed owns the sampling plan (which blocks each data-parallel replica reads at a step),
the attention mode resolved for the corpus, and the per-source token counts a mix
reports; the eval sets are opened here too, with the same attention mode.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import JobConfig
from trainer.data import packing
from trainer.data.blocks import BatchPlan, PackedBlocks, StepBatches
from trainer.data.mixing import MixedBatches, MixPlan
from trainer.data.tokenize import TokenCache
from trainer.errors import UserError


def attention_mode(cfg: JobConfig, train_meta: dict[str, Any]) -> str:
    """`data.attention` resolved for this corpus: auto is document attention for chat and
    prompt/completion rows, causal for plain text and under pipeline parallelism (whose
    stages build their own causal mask; the config refuses an explicit document there)."""
    setting = cfg.data.attention
    if setting == "auto" and getattr(cfg.strategy, "pp", 1) > 1:
        return "causal"
    return packing.resolve(setting, int(train_meta.get("chat_documents", 0)))


def _check_visible(caches: list[str]) -> None:
    for cache in caches:
        if cache and not (Path(cache) / "manifest.json").exists():
            raise UserError(
                f"tokenized data {cache} is not visible on worker node {socket.gethostname()}: "
                "put the data on the shared FS (EFS), mounted at the same path on every node"
            )


@dataclass
class TrainFeed:
    """Micro batches for a step, the plan's sizes, and what a step report says of them."""

    batches: StepBatches | MixedBatches
    plan: BatchPlan | MixPlan
    first: PackedBlocks
    """The first source's blocks: the final probe reads its first block."""
    attention: str
    block_size: int
    mix_names: list[str] | None
    """Source names when several are mixed (their token counts are reported), else None."""

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, ...]]:
        return self.batches.micro_batches(step)

    def source_tokens(self, done: int) -> dict[str, int]:
        """tokens_seen/<source> after `done` steps, for a mix (a plain run reports none)."""
        if self.mix_names is None:
            return {}
        seen = self.plan.counts_before(done) * self.block_size  # type: ignore[union-attr]
        return {f"tokens_seen/{n}": int(t) for n, t in zip(self.mix_names, seen, strict=True)}


def open_feed(
    cfg: JobConfig, train: list[str], eval_: list[str], rank: int, world: int
) -> TrainFeed:
    """The feed for this rank. The global batch is fixed by the config; on fewer workers
    (an elastic run that lost a node) each accumulates more micro steps, and the global
    sample order is unchanged. Workers of one model-parallel group (tp × pp) read the same
    batches: one replica."""
    _check_visible(train + eval_)
    caches = [TokenCache(Path(c)) for c in train]
    chats = sum(int(c.meta.get("chat_documents", 0)) for c in caches)
    attention = attention_mode(cfg, {"chat_documents": chats})
    sources = [PackedBlocks(c, cfg.data.block_size, attention == "document") for c in caches]
    replica, replicas = cfg.data_rank(rank, world)
    micro, accum, seed = cfg.train.micro_batch_size, cfg.grad_accum_for(world), cfg.train.seed
    feed: TrainFeed
    if len(sources) == 1:
        plan = BatchPlan(len(sources[0]), micro, accum, replicas, seed)
        batches = StepBatches(sources[0], plan, replica)
        feed = TrainFeed(batches, plan, sources[0], attention, cfg.data.block_size, None)
    else:
        specs = cfg.data.sources("train")
        mix = MixPlan(
            [len(b) for b in sources], [s.weight for s in specs], micro, accum, replicas, seed
        )
        names = [s.name or "data" for s in specs]
        feed = TrainFeed(
            MixedBatches(sources, mix, replica),
            mix,
            sources[0],
            attention,
            cfg.data.block_size,
            names,
        )
    if feed.steps_per_epoch < 1:
        raise UserError(
            f"{cfg.data.train_file}: {sum(len(b) for b in sources)} blocks of "
            f"{cfg.data.block_size} tokens are fewer than one global batch ({feed.global_batch})"
        )
    return feed


def open_eval_sets(cfg: JobConfig, eval_: list[str], attention: str) -> dict[str, PackedBlocks]:
    """Every eval source's blocks by name, read with the training data's attention mode."""
    return {
        s.name or "data": PackedBlocks(
            TokenCache(Path(c)), cfg.data.block_size, attention == "document"
        )
        for s, c in zip(cfg.data.sources("eval"), eval_, strict=True)
    }
