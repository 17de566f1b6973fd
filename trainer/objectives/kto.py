"""KTO on unpaired feedback: `prompt`/`completion`/`label` rows, each completion judged
desirable or not on its own (TRL's unpaired preference shape and KTOTrainer's loss).

A row's loss compares the policy's log-ratio to the reference with a KL estimate z0:
desirable rows 1 - sigmoid(beta (r - z0)) × desirable_weight, undesirable rows
1 - sigmoid(beta (z0 - r)) × undesirable_weight. z0 is TRL's: the mean, over the micro
batch on every rank, of the policy's minus the reference's log-prob of mismatched
sequences (a row's prompt with another row's completion), clamped at 0 and carrying no
gradient. TRL rotates completions within each sequential batch; here a row's mismatched
completion is the previous row's of its file, fixed when the cache is written, so batches
can be shuffled and, in full fine-tuning, the reference's log-probs of both sequences are
computed once before step 1 (`trainer.objectives.reference`, as for DPO). Under lora/qlora
the reference is the model with its adapter switched off.

The cache is the pair cache (`trainer.objectives.pairs`): block 2i is row i's sequence,
block 2i+1 its mismatched one, and a `.label` byte per row says which rows are desirable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.config import JobConfig
from trainer.data.tokenize import TokenCache
from trainer.errors import DataError
from trainer.objectives import losses
from trainer.objectives.pairs import PairBlocks
from trainer.objectives.preference import PairObjective, adapter_model
from trainer.objectives.sft import RouterTerm

METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


class KTOBlocks(PairBlocks):
    """A KTO cache: `gather(rows)` is (ids, labels, reference log-probs) of the rows'
    sequences, then of their mismatched sequences (the layout the reference pass reads);
    `desirable[i]` is row i's label."""

    unit = "KTO rows"

    def __init__(self, cache: TokenCache, block_size: int):
        super().__init__(cache, block_size)
        parts = [
            np.fromfile(cache.dir / f"{s['file']}.label", dtype=np.uint8)
            for s in cache.meta["shards"]
            if s["tokens"]
        ]
        self.desirable = np.concatenate(parts).astype(bool) if parts else np.zeros(0, bool)
        if len(self.desirable) != len(self):
            raise DataError(f"{cache.dir}: not a KTO cache (labels do not match the rows)")

    def batch_source(self) -> _Labelled:
        return _Labelled(self)


@dataclass
class _Labelled:
    """What the feed gathers: the rows' blocks and their labels."""

    rows: KTOBlocks

    def gather(self, ix: np.ndarray) -> tuple[np.ndarray, ...]:
        return (*self.rows.gather(ix), self.rows.desirable[np.asarray(ix, dtype=np.int64)])


def kto_losses(
    logps: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's weighted loss, its reward beta × log-ratio) given the KL estimate."""
    ratio = logps - ref
    desired = desirable_weight * (1 - F.sigmoid(beta * (ratio - kl)))
    undesired = undesirable_weight * (1 - F.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, desired, undesired), beta * ratio.detach()


def _mean_over_ranks(total: torch.Tensor, count: int) -> torch.Tensor:
    """TRL's gather-then-mean of each rank's micro-batch mean (equal counts: a sum)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.stack([total, torch.tensor(float(count), device=total.device)]).double()
        dist.all_reduce(both)
        return (both[0] / both[1]).to(total.dtype)
    return total / count


class KTO(PairObjective):
    """The objective the loop calls for `train.objective: kto` (see the module's text);
    its feed, reference pass and inputs are the pair objectives' (`PairObjective`), with
    each row's label as `desirable`."""

    kind = KTOBlocks
    extras = ("desirable",)

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.name = "kto"
        p = cfg.train.preference
        self.beta = p.beta_for("kto")
        self.weights = (p.desirable_weight, p.undesirable_weight)
        self.column_reference = cfg.model.adapter == "none"
        self._sums: torch.Tensor | None = None
        self.router = RouterTerm()

    # ---------------------------------------------------------------- the loss

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        num_items: Any,
        desirable: torch.Tensor,
        ref: torch.Tensor | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        """Rows first, their mismatched sequences second (as gathered). The mismatched
        ones only feed z0, in no-grad forwards, as TRL's are."""
        n = len(x) // 2
        if ref is None:
            with torch.no_grad(), adapter_model(model).disable_adapter():
                ref = losses.sequence_logps(model(input_ids=x).logits, y)[0]
        with torch.no_grad():
            kl_logps = losses.sequence_logps(model(input_ids=x[n:]).logits, y[n:])[0]
        kl = _mean_over_ranks((kl_logps - ref[n:].to(kl_logps.dtype)).sum(), n).clamp(min=0)
        with self.router.recording(model) as routed:  # a mixture of experts' aux loss
            logits = model(input_ids=x[:n]).logits
        logps = losses.sequence_logps(logits, y[:n])[0]
        good = desirable.bool()
        ref_rows = ref[:n].to(logps.dtype)
        per_row, rewards = kto_losses(logps, ref_rows, good, kl, self.beta, *self.weights)
        self._record(good, rewards, logps.detach(), kl)
        return per_row.sum() / num_items + self.router.term(model, routed, n, num_items)

    # ---------------------------------------------------------------- metrics

    def _record(
        self, good: torch.Tensor, rewards: torch.Tensor, logps: torch.Tensor, kl: torch.Tensor
    ) -> None:
        bad = ~good
        sums = torch.stack(
            [
                good.sum().to(rewards.dtype),
                bad.sum().to(rewards.dtype),
                rewards[good].sum(),
                rewards[bad].sum(),
                logps[good].sum(),
                logps[bad].sum(),
                kl.detach().to(rewards.dtype),
                torch.ones((), dtype=rewards.dtype, device=rewards.device),
            ]
        ).double()
        self._sums = sums if self._sums is None else self._sums + sums

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """TRL's names: rewards and log-probs as means over the desirable (chosen) and
        undesirable (rejected) rows since the last report, and kl, the mean of the micro
        batches' estimates. Collective."""
        local = [0.0] * 8 if self._sums is None else self._sums.tolist()
        self._sums = None
        good, bad, r_good, r_bad, l_good, l_bad, kl, batches = all_reduce(local)
        out: dict[str, float] = {}
        if batches:
            out["kl"] = kl / batches
        if good:
            out["rewards/chosen"], out["logps/chosen"] = r_good / good, l_good / good
        if bad:
            out["rewards/rejected"], out["logps/rejected"] = r_bad / bad, l_bad / bad
        if good and bad:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return {**out, **self.router.metrics(all_reduce)}
