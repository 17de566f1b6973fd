"""What the model will see, before paying for it: each source's shape, its mapped fields,
the counts of a sample (rows, tokens, rows cut or dropped, the share of tokens trained
on) and its first rows as tokens, the trained ones marked apart from the rest.

The sample is read and encoded by the same reader and encoder the token cache uses
(`trainer.data.shapes`, `trainer.data.encode`), in this process, without Ray: the counts
of a source that fits in the sample are the counts its cache's manifest will hold. Mistakes
in masking (a prompt trained on, an answer left out) show here in a second, on a laptop,
the way axolotl's `preprocess --debug` shows them. Preference pairs are shown with their
chosen and rejected sides together, each completion marked. Imports numpy and
transformers only when it runs: `python -m trainer` builds its parser from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from trainer.config import JobConfig
from trainer.data.shapes import describe, iter_examples
from trainer.data.sources import ScanReport, SourceFile, list_sources

if TYPE_CHECKING:
    from trainer.data.encode import Settings

log = logging.getLogger(__name__)

ONLINE = ("grpo", "rloo")
"""Objectives whose data are prompts the policy answers during training: nothing to mark."""
GREEN, DIM, RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"
OPEN, CLOSE = "[[", "]]"
"""How trained tokens are marked: green (the rest dimmed) on a terminal, else brackets."""


@dataclass
class Counts:
    """A source's sample, counted as the token cache's manifest counts it."""

    rows: int = 0
    tokens: int = 0
    trained: int = 0
    long_rows: int = 0  # longer than a block: split, or dropped (data.long_rows)
    dropped: int = 0
    cut: int = 0  # preference pairs (KTO rows) cut to fit a block
    padded: bool = False  # a pair cache's counts: every sequence padded to a block
    complete: bool = True  # the sample held every row of the source
    shown: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.trained / self.tokens if self.tokens else 0.0


class Marker:
    """Token ids → text with the trained runs marked."""

    def __init__(self, tokenizer: Any, color: bool):
        self.tok, self.color = tokenizer, color

    def runs(self, ids: list[int], mask: list[int]) -> Iterator[tuple[bool, list[int]]]:
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or bool(mask[i]) != bool(mask[start]):
                yield bool(mask[start]), ids[start:i]
                start = i

    def text(self, ids: list[int], mask: list[int]) -> str:
        out = []
        for trained, run in self.runs(ids, mask):
            piece = self.tok.decode(run, skip_special_tokens=False)
            if self.color:
                out.append(f"{GREEN if trained else DIM}{piece}{RESET}")
            else:
                out.append(f"{OPEN}{piece}{CLOSE}" if trained else piece)
        return "".join(out)

    def ids(self, ids: list[int], mask: list[int]) -> str:
        out = []
        for trained, run in self.runs(ids, mask):
            piece = " ".join(map(str, run))
            if self.color:
                out.append(f"{GREEN if trained else DIM}{piece}{RESET}")
            else:
                out.append(f"{OPEN}{piece}{CLOSE}" if trained else piece)
        return " ".join(out)

    def row(self, title: str, ids: list[int], mask: list[int]) -> str:
        return (
            f"  {title} ({len(ids)} tokens, {sum(mask)} trained):\n"
            f"    {self.text(ids, mask)}\n    ids: {self.ids(ids, mask)}"
        )


def _rows(sources: list[SourceFile], limit: int, read: Any) -> Iterator[Any]:
    """The first `limit` items over a source's files, in the cache's order."""
    yield from islice((item for src in sources for item in read(src)), limit)


def count_sft(
    sources: list[SourceFile],
    tokenizer: Any,
    settings: Settings,
    sample: int,
    show: int,
    marker: Marker,
    report: ScanReport,
) -> Counts:
    from trainer.data.encode import Encoder

    enc, counts = Encoder(tokenizer, settings), Counts()
    columns = dict(settings.columns)

    def read(src: SourceFile) -> Iterator[Any]:
        return iter_examples(
            src, settings.on_bad_line, report, settings.endpoint, settings.region, columns
        )

    examples = list(_rows(sources, sample + 1, read))
    counts.complete = len(examples) <= sample
    for ids, mask in enc.encode(examples[:sample]):
        trained = len(ids) if mask is None else int(mask.sum())
        counts.rows += 1  # as the manifest's documents: dropped rows included
        if len(ids) > settings.block_size:
            counts.long_rows += 1
            if settings.long_rows == "drop":
                counts.dropped += 1
                continue
        counts.tokens += len(ids)
        counts.trained += trained
        if len(counts.shown) < show:
            row_mask = [1] * len(ids) if mask is None else mask.tolist()
            counts.shown.append(marker.row(f"row {len(counts.shown) + 1}", ids, row_mask))
    return counts


def count_pairs(
    cfg: JobConfig,
    sources: list[SourceFile],
    tokenizer: Any,
    settings: Settings,
    sample: int,
    show: int,
    marker: Marker,
    report: ScanReport,
) -> Counts:
    """Preference pairs: both sides of each shown pair together, each completion marked.
    KTO's unpaired rows: the prompt and the one completion, with its label."""
    from trainer.objectives.pairs import PairEncoder, cut_pair, pair_settings
    from trainer.objectives.rows import iter_pairs, iter_unpaired

    ps = pair_settings(cfg, settings)
    enc, counts = PairEncoder(tokenizer, ps), Counts(padded=True)
    kto = cfg.train.objective == "kto"
    rows_of = iter_unpaired if kto else iter_pairs

    def read(src: SourceFile) -> Iterator[Any]:
        return rows_of(src, ps.on_bad_line, report, ps.endpoint, ps.region, dict(ps.columns))

    rows = list(_rows(sources, sample + 1, read))
    counts.complete = len(rows) <= sample
    kinds = sorted({getattr(r, "shape", "") for r in rows} - {""})
    report.shape = "unpaired feedback (KTO)" if kto else "preference pairs"
    if kinds:
        report.shape += f": {', '.join(kinds)}"
    for row in rows[:sample]:
        if kto:
            prompt, (ids,) = enc.split(row.prompt, (row.completion,))
            prompt, ids, _, cut = cut_pair(prompt, ids, ids, ps.block_size, ps.max_prompt_tokens)
            sides = [("desirable" if row.desirable else "undesirable", ids)]
        else:
            prompt, chosen, rejected = enc.encode(row)
            prompt, chosen, rejected, cut = cut_pair(
                prompt, chosen, rejected, ps.block_size, ps.max_prompt_tokens
            )
            sides = [("chosen", chosen), ("rejected", rejected)]
        counts.rows += 1
        counts.cut += cut
        # as the pair cache holds them: every sequence (a KTO row's mismatched one too)
        # padded to one block; the trained tokens are the completions (their EOS included)
        counts.tokens += 2 * ps.block_size
        counts.trained += sum(len(ids) for _, ids in sides)
        if len(counts.shown) < show * len(sides):
            n = len(counts.shown) // len(sides) + 1
            for side, ids in sides:
                mask = [0] * len(prompt) + [1] * len(ids)
                counts.shown.append(
                    marker.row(f"{'row' if kto else 'pair'} {n} {side}", prompt + ids, mask)
                )
    return counts


def preview(
    cfg: JobConfig, sample: int = 1000, show: int = 3, color: bool = False, tokenizer: Any = None
) -> str:
    """The report for every train and eval source of a job, as text."""
    from trainer.data.encode import Settings, read_chat_template

    if tokenizer is None:
        from trainer.model.loading import load_tokenizer, local_tokenizer_dir

        tokenizer = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    d = cfg.data
    base = Settings(
        append_eos=d.append_eos,
        on_bad_line=d.on_bad_line,
        loss_on=d.loss_on,
        chat_template=read_chat_template(d.chat_template),
        long_rows=d.long_rows,
        block_size=d.block_size,
        endpoint=cfg.storage.endpoint_override,
        region=cfg.storage.region,
    )
    marker = Marker(tokenizer, color)
    out = []
    for which in ("train", "eval"):
        for spec in d.sources(which):
            columns = d.columns_for(spec)
            settings = Settings(**{**base.__dict__, "columns": tuple(sorted(columns.items()))})
            sources = list_sources(spec.path, settings.endpoint, settings.region)
            report = ScanReport()
            if cfg.train.objective == "sft":
                counts = count_sft(sources, tokenizer, settings, sample, show, marker, report)
            elif cfg.train.objective in ONLINE:
                out.append(f"{which} source {spec.name} ({spec.path}): prompts for online RL")
                continue
            else:
                counts = count_pairs(
                    cfg, sources, tokenizer, settings, sample, show, marker, report
                )
            out.append(
                _section(which, spec.name or spec.path, spec.path, report, counts, d, columns)
            )
            out.extend(counts.shown)
    return "\n".join(out)


def _section(
    which: str,
    name: str,
    path: str,
    report: ScanReport,
    counts: Counts,
    d: Any,
    columns: dict[str, str],
) -> str:
    what = describe(report, columns)
    scope = "every row" if counts.complete else f"the first {counts.rows} rows"
    long = "dropped" if d.long_rows == "drop" else "split"
    trained = f"{counts.trained} trained ({100 * counts.share:.1f} %)"
    if counts.padded:  # a pair cache: one padded block per sequence, nothing packed
        counted = (
            f"{counts.tokens} tokens in {counts.tokens // d.block_size} padded blocks, "
            f"{trained}; {counts.cut} cut to fit a block of {d.block_size}"
        )
    else:
        counted = (
            f"{counts.tokens} tokens, {trained}; {counts.long_rows} longer than a block of "
            f"{d.block_size} ({long}), {counts.dropped} dropped"
        )
    lines = [
        f"{which} source {name} ({path}): {what}",
        f"  {scope}: {counts.rows} rows, {counted}, {report.skipped} bad rows skipped",
    ]
    lines += [f"  skipped {s}" for s in report.first_skipped]
    return "\n".join(lines)


def add_arguments(p: Any) -> None:
    """The options of `python -m trainer data` and `raylift data` (one parser, two doors)."""
    p.add_argument("config", help="job YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="F=V")
    p.add_argument("--rows", type=int, default=3, help="rows (pairs) shown per source")
    p.add_argument("--sample", type=int, default=1000, help="rows counted per source")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="mark trained tokens in colour (auto: on a terminal), else in [[brackets]]",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def run(args: Any, stream: Any) -> int:
    """Print the preview of `args.config` to `stream`."""
    from trainer.config import load_config

    cfg = load_config(args.config, args.overrides)
    tty = hasattr(stream, "isatty") and stream.isatty()
    color = args.color == "always" or (args.color == "auto" and tty)
    print(preview(cfg, sample=args.sample, show=args.rows, color=color), file=stream)
    return 0
