"""Preference pairs through the token cache: one block per sequence, chosen beside rejected.

A pair is tokenized once, like SFT rows (`trainer.data.tokenize.prepare`, the same source
listing, S3 reads and cache folder), by this module's engine: the prompt, then each
completion, each padded to exactly `data.block_size` tokens, so block 2i is pair i's
chosen sequence and block 2i+1 its rejected one. Pairs are never packed: a padded row
costs the padding, and no pair can attend to another. Only completion tokens (and the EOS
that ends them) are targets. The ids are TRL 1.16's (`PairEncoder`). KTO's unpaired rows
use the same cache: a row's sequence, then its mismatched (KL) sequence, and a label.

Too long a pair is cut the same way on both sides, so chosen and rejected keep one prompt:
the prompt loses tokens from the left (its end, next to the answer, matters most) down to
`train.preference.max_prompt_tokens` (half a block by default), then both completions are
cut on the right to fit. The count of cut pairs is reported.

Training samples pairs, not blocks: `BatchPlan` runs over pair indices, so a micro batch
is `micro_batch_size` whole pairs, laid out as TRL does, every chosen row first, then the
rejected rows in the same order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import JobConfig
from trainer.data.blocks import BatchPlan, PackedBlocks, StepBatches
from trainer.data.sources import ScanReport, SourceFile
from trainer.data.tokenize import Settings, ShardStats, TokenCache, token_dtype
from trainer.errors import DataError, UserError
from trainer.objectives.rows import Pair, iter_pairs, iter_unpaired

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairSettings(Settings):
    """Settings of a pair cache: what changes its tokens besides the rows and tokenizer."""

    max_prompt_tokens: int = 512
    unpaired: bool = False  # KTO's prompt/completion/label rows

    PAIR_VERSION = 2
    """Bumped when a pair cache's contents change without its settings: 2, the manifest
    records trained_tokens (a cache written before held 0, and `raylift data` read it)."""

    def key(self) -> str:
        kind = "kto" if self.unpaired else "pairs-trl"
        mine = f"{kind}|p{self.PAIR_VERSION}|block={self.block_size}"
        return f"{mine}|prompt={self.max_prompt_tokens}|" + super().key()


def pair_settings(cfg: JobConfig, base: Settings) -> PairSettings:
    block = cfg.data.block_size
    keep = cfg.train.preference.max_prompt_tokens or block // 2
    return PairSettings(
        **dataclasses.asdict(base) | {"block_size": block},
        max_prompt_tokens=max(1, min(keep, block - 1)),
        unpaired=cfg.train.objective == "kto",
    )


def cut_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], block: int, max_prompt: int
) -> tuple[list[int], list[int], list[int], bool]:
    """(prompt, chosen, rejected) cut together to fit one block each; True if cut."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= block:
        return prompt, chosen, rejected, False
    keep = min(len(prompt), max(max_prompt, block - longest))
    prompt = prompt[len(prompt) - keep :]
    room = block - len(prompt)
    return prompt, chosen[:room], rejected[:room], True


class PairEncoder:
    """Pair → (prompt ids, chosen ids, rejected ids), tokenized as TRL 1.16's DPOTrainer
    does: the prompt alone, and the prompt followed by each completion, each in one piece;
    the completion starts where the prompt's ids and the whole's ids part (a template may
    render the prompt alone differently, or tokens merge across the boundary). Plain text:
    the tokenizer's special tokens (BOS), and EOS appended to each completion. Chat: the
    prompt rendered with the generation prompt, the whole as the template renders it."""

    def __init__(self, tokenizer: Any, settings: Settings):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token if settings.append_eos else None
        self.template = settings.chat_template or getattr(tokenizer, "chat_template", None)
        self._warned = False

    def encode(self, pair: Pair) -> tuple[list[int], list[int], list[int]]:
        prompt, (chosen, rejected) = self.split(pair.prompt, (pair.chosen, pair.rejected))
        return prompt, chosen, rejected

    def split(self, prompt: Any, completions: tuple[Any, ...]) -> tuple[list[int], list[list[int]]]:
        """(prompt ids, each completion's ids) for one prompt and its completions."""
        if isinstance(prompt, str):
            head = self._text(prompt)
            wholes = [self._text(prompt + self._with_eos(c)) for c in completions]
        else:
            head = self._chat(prompt, True)
            wholes = [self._chat(prompt + c, False) for c in completions]
        keep = min(_shared(head, whole) for whole in wholes)
        if keep < len(head) and not self._warned:
            self._warned = True
            log.warning(
                "the tokenized prompt is not a prefix of prompt + completion (the chat template "
                "renders it differently alone, or tokens merge across the boundary); the "
                "completion starts where they part: %r",
                self.tok.decode(head[keep:]),
            )
        return head[:keep], [whole[keep:] for whole in wholes]

    def _with_eos(self, text: str) -> str:
        if self.eos is not None and not text.endswith(self.eos):
            return text + self.eos
        return text

    def _text(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def _chat(self, msgs: Any, gen: bool) -> list[int]:
        if not self.template:
            raise UserError(
                "chat rows need a chat template: the tokenizer has none; set data.chat_template"
            )
        out = self.tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in msgs],
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=gen,
        )
        return list(out["input_ids"])


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _pad_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def _pair_rows(src: SourceFile, enc: PairEncoder, settings: PairSettings, report: ScanReport):
    """(prompt, chosen, rejected, None, cut) for each pair of `src`, logging the shapes."""
    shapes: Counter[str] = Counter()
    columns = dict(settings.columns)
    for pair in iter_pairs(
        src, settings.on_bad_line, report, settings.endpoint, settings.region, columns
    ):
        shapes[pair.shape] += 1
        prompt, chosen, rejected, cut = cut_pair(
            *enc.encode(pair), settings.block_size, settings.max_prompt_tokens
        )
        yield prompt, chosen, rejected, None, cut
    log.info(
        "%s: pairs read as %s",
        src.uri,
        ", ".join(f"{shape} ({n})" for shape, n in shapes.most_common()) or "nothing",
    )


def _unpaired_rows(src: SourceFile, enc: PairEncoder, settings: PairSettings, report: ScanReport):
    """(prompt, completion, KL completion, desirable, cut) for each KTO row of `src`. The
    KL completion is the previous row's (the first row takes the last's): TRL's
    mismatched pairs, fixed by file order so a reference can be computed for them once."""
    rows = [
        (*enc.split(row.prompt, (row.completion,)), row.desirable)
        for row in iter_unpaired(
            src,
            settings.on_bad_line,
            report,
            settings.endpoint,
            settings.region,
            dict(settings.columns),
        )
    ]
    if len(rows) == 1:
        log.warning("%s: one KTO row; its KL estimate compares it with itself", src.uri)
    block = settings.block_size
    for i, (prompt, (completion,), desirable) in enumerate(rows):
        prompt, completion, _, cut = cut_pair(
            prompt, completion, completion, block, settings.max_prompt_tokens
        )
        mismatched = rows[i - 1][1][0][: block - len(prompt)]
        yield prompt, completion, mismatched, desirable, cut
    log.info("%s: %d KTO rows (prompt, completion, label)", src.uri, len(rows))


def tokenize_pairs(
    sources: list[SourceFile], folder: Path, tokenizer: Any, settings: Settings, progress: bool
) -> list[ShardStats]:
    """The pair engine for `trainer.data.tokenize.prepare`: one shard per input file, each
    sequence one block (`.bin` ids, `.mask` targets, `.docs` the block ends). KTO's rows
    are a sequence and its KL sequence, with a `.label` byte per row (1: desirable)."""
    assert isinstance(settings, PairSettings)
    enc = PairEncoder(tokenizer, settings)
    dtype, block, pad = token_dtype(tokenizer), settings.block_size, _pad_id(tokenizer)
    read = _unpaired_rows if settings.unpaired else _pair_rows
    out = []
    for i, src in enumerate(sources):
        stem = f"shard-{i:05d}"
        stats = ShardStats(file=stem, source=src.uri, masked=True)
        report = ScanReport()
        ids_rows: list[np.ndarray] = []
        mask_rows: list[np.ndarray] = []
        labels: list[int] = []
        for prompt, first, second, label, cut in read(src, enc, settings, report):
            stats.long_rows += cut
            # the loss's tokens: both completions of a pair; a KTO row's own completion
            # (its mismatched sequence only feeds the KL estimate, without a gradient)
            stats.trained += len(first) + (0 if settings.unpaired else len(second))
            labels.append(int(bool(label)))
            for completion in (first, second):
                ids = np.full(block, pad, dtype=dtype)
                mask = np.zeros(block, dtype=np.uint8)
                ids[: len(prompt)] = prompt
                ids[len(prompt) : len(prompt) + len(completion)] = completion
                mask[len(prompt) : len(prompt) + len(completion)] = 1
                ids_rows.append(ids)
                mask_rows.append(mask)
        n = len(ids_rows)
        (folder / f"{stem}.bin").write_bytes(
            np.asarray(ids_rows, dtype=dtype).tobytes() if n else b""
        )
        (folder / f"{stem}.mask").write_bytes(np.asarray(mask_rows).tobytes() if n else b"")
        if settings.unpaired:
            (folder / f"{stem}.label").write_bytes(np.asarray(labels, dtype=np.uint8).tobytes())
        ends = np.arange(1, n + 1, dtype=np.int64) * block
        (folder / f"{stem}.docs").write_bytes(ends.tobytes())
        stats.tokens = n * block
        stats.documents, stats.skipped = report.documents, report.skipped
        stats.first_skipped = report.first_skipped
        out.append(stats)
    return out


# ---------------------------------------------------------------- reading pairs


class PairBlocks:
    """Pairs out of a pair cache: `gather(pairs)` is (input ids, labels, reference
    log-probs), 2 × len(pairs) rows, chosen rows first. The reference column is NaN until
    `trainer.objectives.reference` fills it."""

    unit = "pairs"  # what the feed's errors count

    def __init__(self, cache: TokenCache, block_size: int):
        self.blocks = PackedBlocks(cache, block_size)
        self.cache = cache
        if len(self.blocks) % 2:
            raise DataError(f"{cache.dir}: not a pair cache (an odd number of blocks)")
        self.reference = np.full(len(self.blocks), np.nan)

    def __len__(self) -> int:
        return len(self.blocks) // 2

    def rows(self, pairs: np.ndarray) -> np.ndarray:
        pairs = np.asarray(pairs, dtype=np.int64)
        return np.concatenate([2 * pairs, 2 * pairs + 1])

    def gather(self, pairs: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = self.rows(pairs)
        ids, labels = self.blocks.gather(rows)
        return ids, labels, self.reference[rows]

    def batch_source(self) -> Any:
        """What the step's batches gather from: the pairs themselves here; a cache with a
        column per row beyond them (KTO's labels) wraps itself to add it."""
        return self


@dataclass
class PairFeed:
    """The loop's feed (see trainer.data.feed.TrainFeed) over pairs."""

    batches: StepBatches
    plan: BatchPlan
    first: PairBlocks
    block_size: int
    attention: str = "causal"

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, ...]]:
        return self.batches.micro_batches(step)

    def source_tokens(self, done: int) -> dict[str, int]:
        return {}


def open_pair_feed(
    cfg: JobConfig, train: list[str], rank: int, world: int, kind: type[PairBlocks] = PairBlocks
) -> PairFeed:
    """The loop's feed over a pair cache (`kind` reads it: pairs, or KTO's labelled rows):
    batches are sampled by pair, so a micro batch holds whole pairs."""
    pairs = kind(TokenCache(Path(train[0])), cfg.data.block_size)
    replica, replicas = cfg.data_rank(rank, world)
    plan = BatchPlan(
        len(pairs), cfg.train.micro_batch_size, cfg.grad_accum_for(world), replicas, cfg.train.seed
    )
    if plan.steps_per_epoch < 1:
        raise UserError(
            f"{cfg.data.train_file}: {len(pairs)} {pairs.unit} are fewer than one global batch "
            f"({plan.global_batch} {pairs.unit})"
        )
    batches = StepBatches(pairs.batch_source(), plan, replica)
    return PairFeed(batches, plan, pairs, cfg.data.block_size)


def data_options(cfg: JobConfig, settings: Settings) -> dict[str, Callable[..., Any] | Settings]:
    """What `prepare` takes to build a pair cache instead of a token stream."""
    return {"settings": pair_settings(cfg, settings), "tokenize_shards": tokenize_pairs}


def fingerprint(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
