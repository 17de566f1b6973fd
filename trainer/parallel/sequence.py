"""Sequence parallelism (Ulysses): each sequence split over `sp` consecutive workers.

What a long sequence leaves on one GPU, once the chunked loss has removed the logits, is
its activations: every decoder layer's inputs, norms, MLP intermediates, all linear in the
sequence length. Ulysses (DeepSpeed's, as ALST ships it for Hugging Face models) splits
the sequence dimension over the sp workers of a group, so each holds 1/sp of every one of
them; only attention needs the whole sequence, and gets it through an all-to-all that
trades the sequence split for a head split (each worker: all tokens, heads/sp heads), the
attention kernel unchanged, then the reverse all-to-all. Everything else in a decoder
layer is per token.

The pieces, each small:
- `SequenceGroup`: the sp process groups (consecutive ranks, as trainer.config's
  `data_rank` hands one batch to the workers of one group) and this worker's place in it.
- `shard_batch`: a micro batch's share of one worker: its tokens, its *already shifted*
  targets (the next token of the last token of a share lives on the next worker, so the
  shift is made on the whole sequence first and travels as `shift_labels`), its global
  positions (restarted per packed document when the batch is packed), and the whole
  sequence's attention mask (document boundaries stay where they were).
- `ulysses_attention`: registered with transformers' attention and mask interfaces under
  one name per kernel (`raylift_sp_sdpa`, `raylift_sp_eager`), so any model that reads
  `config._attn_implementation` runs its own projections, rotary and output, and only the
  kernel call is wrapped. It is active only while a sharded loss runs (`SequenceGroup.
  sharding`); evaluation and probes run whole sequences through the plain kernel.
- `SequenceShard`: the objective seen by the loop: the same feed (one batch per group),
  each worker's count of its own targets, its shard as inputs, and its loss.

Why not DeepSpeed's `UlyssesSPAttentionHF` itself: it drops every 4-D mask (it relies on
flash-attention's varlen detection from position ids), so packed documents under sdpa
or eager would attend across documents; it keeps its groups in a module-global `mpu` and
replaces the sdpa entry of transformers' registry for every model in the process. The
exchange here is torch's differentiable functional `all_to_all_single_autograd`, which
gloo runs on CPU.

A loss over whole sequences' sums (DPO and its kin: `split_sequences`) gets them whole:
each worker sums its share's target log-probs (and counts) per row, and one all-reduce over
the group, differentiable (its backward all-reduces the gradients of every worker's copy of
the loss), makes the rows' sums on every worker; each worker then returns 1/sp of the pair
loss, a pair counting once per group (on its first worker), so the gradients summed over
the group are the whole loss's. The LoRA reference (adapter off) and the precomputed
reference pass (`row_logps`) go through the same sharded forward and sum.

The loss is exact by construction: each worker's loss is its own targets' token sum over
the step's divisor (the loop's global target count / world, counted from `count`, i.e.
each worker's own share), and the strategies average gradients over every worker (FSDP2
and DDP span the whole world, dp × sp); the all-to-all's backward carries each worker's
attention gradients to the workers whose tokens made them. The value returned for the
report is the group's (all-reduced over sp, / sp), so every worker of a replica reports
its replica's loss, as the strategies' contract says.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

IGNORE = -100
"""trainer.data.tokenize.IGNORE: the label the loss skips."""

KERNELS = ("sdpa", "eager")
"""The attention kernels this build wraps (trainer.data.packing's document mask takes
these two)."""


@dataclass
class SequenceGroup:
    """This worker's sequence-parallel group: `size` consecutive ranks, `rank` its index."""

    group: Any
    size: int
    rank: int
    active: bool = field(default=False)

    @contextlib.contextmanager
    def sharding(self) -> Iterator[None]:
        """While inside, the wrapped attention exchanges shares over the group."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def share(self, length: int) -> slice:
        """This worker's positions of a sequence of `length` tokens."""
        if length % self.size:
            raise ValueError(
                f"a sequence of {length} tokens does not split into {self.size} equal shares"
            )
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the group of every worker's `partial` (per-row sums of its share),
        differentiable: each worker's loss is then the same function of the same totals,
        and the backward all-reduces their gradients, so each share's slice of the graph
        gets the whole loss's gradient (see `SequenceShard`)."""
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(partial.contiguous(), "sum", self.group)


def new_group(sp: int) -> SequenceGroup:
    """The sp groups of consecutive ranks (every rank creates every group: new_group is
    collective), and this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp:
        raise RuntimeError(f"{world} workers do not split into sequence groups of {sp}")
    mine = None
    for start in range(0, world, sp):
        g = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = g
    return SequenceGroup(mine, sp, rank % sp)


# ------------------------------------------------------------------ the batch's shares


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next token on the whole sequence (the last one's is ignored): what
    Hugging Face's causal-LM loss takes as `shift_labels`."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def own_targets(labels: np.ndarray, sg: SequenceGroup) -> int:
    """Targets of this worker's share of a host batch's labels (after the shift)."""
    shifted = np.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    return int((shifted[:, sg.share(labels.shape[1])] != IGNORE).sum())


def shard_batch(
    x: torch.Tensor, y: torch.Tensor, attention: dict[str, Any], sg: SequenceGroup
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This worker's (tokens, shifted targets, attention kwargs) of a whole micro batch:
    positions are the whole sequence's (restarted per document where the batch is packed),
    the mask stays the whole sequence's (the kernel sees whole sequences)."""
    part = sg.share(x.shape[1])
    targets = shift_targets(y)[:, part].contiguous()
    kw = dict(attention)
    positions = kw.get("position_ids")
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    kw["position_ids"] = positions[:, part].contiguous()
    kw["shift_labels"] = targets
    return x[:, part].contiguous(), targets, kw


# ------------------------------------------------------------------ the exchange


def _exchange(t: torch.Tensor, group: Any) -> torch.Tensor:
    """all_to_all over dim 0 (one slice per worker), differentiable: torch's functional
    collective (torch.distributed.nn.functional's is deprecated in favour of it)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(t.contiguous(), None, None, group)


def seq_to_heads(t: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """[batch, heads, L, dim] (this worker's tokens, every head) → [batch, heads/sp,
    sp·L, dim] (every token, this worker's heads: rank r gets heads r·h .. r·h + h - 1)."""
    b, h, n, d = t.shape
    parts = t.reshape(b, sg.size, h // sg.size, n, d).transpose(0, 1).contiguous()
    got = _exchange(parts, sg.group)  # [sp (whose tokens), b, h/sp, L, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sg.size, sg.size * n, d)


def heads_to_seq(t: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """The kernel's output [batch, sp·L, heads/sp, dim] → [batch, L, heads, dim]."""
    b, total, h, d = t.shape
    n = total // sg.size
    parts = t.reshape(b, sg.size, n, h, d).transpose(0, 1).contiguous()
    got = _exchange(parts, sg.group)  # [sp (whose heads), b, L, h, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, sg.size * h, d)


# ------------------------------------------------------------------ the attention


def _kernel(module: torch.nn.Module, core: str) -> Callable[..., Any]:
    """The kernel the model would call: eager is its modeling file's own function."""
    if core == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[core]


def _full_mask(module: torch.nn.Module, core: str, q: torch.Tensor, mask: Any, total: int) -> Any:
    """The whole sequence's mask: the caller's when it spans the whole sequence (packed
    documents: trainer.data.packing's block mask), else the causal one rebuilt for
    `total` tokens (what transformers built was for the share). sdpa's plain causal case
    stays None (its is_causal path, no L² mask)."""
    if torch.is_tensor(mask) and mask.shape[-1] == total:
        return mask
    window = getattr(module, "sliding_window", None)
    if core == "sdpa" and not (window and window < total):
        return None
    allowed = torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    if window and window < total:
        allowed = allowed.triu(-(window - 1))
    allowed = allowed[None, None]
    if core == "sdpa":
        return allowed
    out = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    return out.masked_fill_(~allowed, torch.finfo(q.dtype).min)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function signature. With the group sharding: shares →
    heads, the model's kernel on whole sequences, heads → shares; else the kernel alone."""
    sg: SequenceGroup = module._raylift_sp  # type: ignore[assignment]
    core: str = module._raylift_sp_core  # type: ignore[assignment]
    kernel = _kernel(module, core)
    if not sg.active:
        mask = attention_mask
        return kernel(module, query, key, value, mask, *args, **kwargs)
    q, k, v = (seq_to_heads(t, sg) for t in (query, key, value))
    mask = _full_mask(module, core, q, attention_mask, q.shape[2])
    kwargs.pop("position_ids", None)  # the share's; the kernels here do not read them
    out, weights = kernel(module, q, k, v, mask, *args, **kwargs)
    return heads_to_seq(out, sg), weights


def model_attention(model: torch.nn.Module) -> str:
    """The attention implementation `model`'s config names (through DDP and PEFT)."""
    from transformers import PretrainedConfig

    found = (getattr(m, "config", None) for m in model.modules())
    return next(c for c in found if isinstance(c, PretrainedConfig))._attn_implementation


def attention_name(core: str) -> str:
    return f"raylift_sp_{core}"


def install(model: torch.nn.Module, sg: SequenceGroup) -> None:
    """Route `model`'s attention through Ulysses over `sg` (before any wrapping: FSDP2,
    PEFT and DDP keep the attention modules and the config)."""
    from transformers import AttentionInterface, PretrainedConfig
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    # The model's config, through DDP (which has none) and PEFT (which shares it).
    found = (getattr(m, "config", None) for m in model.modules())
    config = next(c for c in found if isinstance(c, PretrainedConfig))
    core = config._attn_implementation
    if core not in KERNELS:
        raise ValueError(
            f"strategy.sp: attention {core!r} is not one sequence parallelism wraps in this "
            f"build ({', '.join(KERNELS)}); set model.attn_implementation to sdpa"
        )
    name = attention_name(core)
    AttentionInterface.register(name, ulysses_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[core])
    for m in model.modules():
        if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim"):
            m._raylift_sp = sg
            m._raylift_sp_core = core
    for conf in {id(c): c for c in (config, getattr(config, "text_config", None)) if c}.values():
        conf._attn_implementation = name


# ------------------------------------------------------------------ the objective


class SequenceShard:
    """An objective whose batches are split over the sequence group: the loop and the
    strategies call it as they call the objective it wraps."""

    def __init__(self, inner: Any, sg: SequenceGroup):
        self.inner, self.sg = inner, sg
        self.name = inner.name
        # A loss over whole-sequence sums (DPO and its kin) gets the group's sum of its
        # per-row partials; its items (pairs) are counted once per group, on its first
        # worker; every worker's loss is then the group's whole loss, so each returns 1/sp
        # of it (its share of the group's sum, as a token loss's share is).
        self.whole = hasattr(inner, "split_sequences")
        if self.whole:
            inner.split_sequences(sg.total)

    def open_feed(self, train: list[str], eval_: list[str], rank: int, world: int) -> Any:
        return self.inner.open_feed(train, eval_, rank, world)

    def before_training(self, strategy: Any, feed: Any, rt: Any) -> None:
        self.inner.before_training(strategy, feed, rt)

    def count(self, batch: tuple[np.ndarray, ...]) -> int:
        """This worker's own items: summed over the group, the batch's (targets: each
        worker's own; whole-sequence items: all on the group's first worker)."""
        if self.whole:
            return self.inner.count(batch) if self.sg.rank == 0 else 0
        return own_targets(batch[1], self.sg)

    def inputs(
        self,
        batch: tuple[np.ndarray, ...],
        device: torch.device,
        attend: Callable[[list[np.ndarray]], dict[str, Any]],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        x, y, kw = self.inner.inputs(batch, device, attend)
        return shard_batch(x, y, kw, self.sg)

    def row_logps(self, strategy: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The reference pass's column (whole rows `x`, labels `y`): each worker forwards
        its share of every row, the inner objective totals the rows' sums over the group."""
        xs, targets, kw = shard_batch(x, y, {}, self.sg)
        with self.sg.sharding():
            return self.inner.row_logps(strategy, xs, targets, **kw)

    def loss(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_items: Any, **kw: Any
    ) -> torch.Tensor:
        """This worker's loss with its graph; its value the group's mean (see module doc)."""
        with self.sg.sharding():
            mine = self.inner.loss(model, x, y, num_items, **kw)
        if self.whole:
            mine = mine / self.sg.size
        group = mine.detach().clone()
        dist.all_reduce(group, group=self.sg.group)
        return mine + (group / self.sg.size - mine).detach()

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        return self.inner.metrics(all_reduce)


def wrap(objective: Any, model: torch.nn.Module, sp: int) -> Any:
    """The job's objective under sequence parallelism (as is for sp 1); installs Ulysses
    on `model`. Collective (it creates the process groups)."""
    if sp == 1:
        return objective
    sg = new_group(sp)
    install(model, sg)
    if dist.get_rank() == 0:
        log.info(
            "sequence parallel: each sequence split over %d workers (Ulysses around %s)",
            sp,
            model_attention(model),
        )
    return SequenceShard(objective, sg)
