"""An lm-eval `LM` over the model as the strategy holds it, its requests split over ranks.

lm-eval's own data parallelism splits *documents* per rank and needs an accelerate
launcher; here every rank runs lm-eval's whole flow as if alone (it reports rank 0 of 1
to lm-eval, so each builds the same requests in the same order), and the split happens
below, in this class: rank r scores requests r, r+W, r+2W, ... and the results are
gathered back into request order on every rank. So the scores are those of one process,
whatever the layout, and the strategy's forward runs with every rank taking part, as
FSDP2 and ZeRO-3 need (each layer's shards are gathered as it runs): every rank makes the
same number of forward passes (the shorter shares are padded with a repeat whose result
is dropped), and generation passes `synced_gpus` so a rank that finished decoding keeps
stepping until all have.

Log-likelihoods are computed the way lm-eval's HFLM computes them (the same tokenisation
rules, left truncation to the model's length, log-softmax in fp32), so they match
`lm_eval.simple_evaluate` on the exported folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import stop_sequences_criteria

from trainer.rollouts.generate import unwrap

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_LENGTH = 2048
"""HFLM's length when neither the config nor the tokenizer gives one."""


class Scorer(Protocol):
    """What the LM needs of a strategy (trainer.strategies.base.Strategy has it)."""

    model: torch.nn.Module

    def logits(self, x: torch.Tensor, **attention: Any) -> torch.Tensor: ...


def share(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s requests: every world-th from `rank`, padded with a repeat of the
    last item to ceil(n / world), so every rank makes the same number of passes."""
    if not items:
        return []
    per_rank = -(-len(items) // world)
    mine = list(items[rank::world])
    return mine + [items[-1]] * (per_rank - len(mine))


def in_request_order(per_rank: Sequence[Sequence[R]], n: int) -> list[R]:
    """The results of `share`'s split, gathered from every rank, back in request order:
    request i was rank i % W's (i // W)-th; the padding repeats are dropped."""
    world = len(per_rank)
    return [per_rank[i % world][i // world] for i in range(n)]


def split_over_ranks(
    items: Sequence[T], run: Callable[[list[T]], list[R]], rank: int, world: int
) -> list[R]:
    """`run` over this rank's share; every rank gets every result, in request order."""
    if world == 1:
        return run(list(items))
    mine = run(share(items, rank, world))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return in_request_order(gathered, len(items))


class ShardedLM(TemplateLM):
    """lm-eval's model interface over `scorer.logits` (call inside the strategy's
    `evaluating()`); `batch_size` requests share one forward pass (right-padded: the
    causal model never looks at the padding of the positions that are read)."""

    def __init__(
        self,
        scorer: Scorer,
        tokenizer: Any,
        device: torch.device,
        *,
        rank: int = 0,
        world: int = 1,
        batch_size: int = 8,
        max_length: int | None = None,
    ):
        super().__init__()
        self.scorer, self.tokenizer, self._device = scorer, tokenizer, device
        self.shard_rank, self.shard_world = rank, world
        self.batch_size = batch_size
        config = getattr(unwrap(scorer.model), "config", None)
        self._max_length = max_length or resolve_max_length(
            config, tokenizer, default=DEFAULT_MAX_LENGTH
        )

    # lm-eval sees one process: every rank builds every request (see the module docstring).
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """HFLM's rule: the tokenizer's own special tokens unless told, and none when the
        string already starts with the BOS text."""
        extra: dict[str, bool] = {}
        if add_special_tokens is not None:
            extra["add_special_tokens"] = add_special_tokens
        elif has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            extra["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **extra)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    # ------------------------------------------------------------------ log-likelihoods

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        return split_over_ranks(pairs, self._score, self.shard_rank, self.shard_world)

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether it is the greedy one) per pair,
        `batch_size` pairs a forward pass; collective under a sharded strategy."""
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in chunk]
            width = max(len(r) for r in rows)
            x = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            logits = self.scorer.logits(x.to(self._device))
            logp = F.log_softmax(logits.float(), dim=-1).cpu()
            for i, ((_, cont), r) in enumerate(zip(chunk, rows, strict=True)):
                n = len(cont)
                picked = logp[i, len(r) - n : len(r)]  # the positions predicting `cont`
                target = torch.tensor(cont, dtype=torch.long)
                greedy = bool((picked.argmax(dim=-1) == target).all())
                out.append((float(picked.gather(1, target[:, None]).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in disjoint windows of the model's length, as HFLM
        (perplexity tasks); all windows of all texts split over ranks together."""
        windows: list[tuple[tuple[str, str], list[int], list[int]]] = []
        owner: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((("", ""), ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores, strict=True):
            totals[i] += logprob
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        return split_over_ranks(args, self._generate, self.shard_rank, self.shard_world)

    def _generate(self, args: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """One request a `generate` call, greedy unless the task samples; `synced_gpus`
        under several ranks (a sharded forward is collective, so every rank must run as
        many decoding steps). The model is used as the strategy holds it, never copied."""
        model = unwrap(self.scorer.model)
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        pad = self.tokenizer.pad_token_id
        out = []
        for context, gen_kwargs in args:
            kwargs: dict[str, Any] = dict(normalize_gen_kwargs(dict(gen_kwargs), 256))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            x = torch.tensor([ids], dtype=torch.long, device=self._device)
            if not kwargs.get("do_sample"):
                kwargs.pop("temperature", None)
                kwargs["do_sample"] = False
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_length=x.shape[1] + max_gen,
                stopping_criteria=stop_sequences_criteria(self.tokenizer, until, x.shape[1], 1),
                pad_token_id=pad if pad is not None else self.eot_token_id,
                synced_gpus=self.shard_world > 1,
                **kwargs,
            )
            text = self.tokenizer.decode(gen[0, x.shape[1] :].tolist(), skip_special_tokens=True)
            out.append(postprocess_generated_text(text, until, None))
        return out
