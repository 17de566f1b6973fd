"""Preference objectives: DPO (sigmoid), IPO and hinge against a reference; SimPO and ORPO
without one. A micro batch is whole pairs (chosen rows, then rejected rows); its loss is
the sum of its pairs' losses over the step's pair count, so a step's loss is the mean over
the global batch's pairs however they are split into micro batches and ranks.

One model in memory: under lora/qlora the reference is the same model with its adapter
switched off (a no-grad forward before the policy's); in full fine-tuning it is the column
of log-probs `trainer.objectives.reference` computed before step 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig
from trainer.objectives import losses
from trainer.objectives.pairs import PairBlocks, PairFeed, open_pair_feed
from trainer.objectives.sft import RouterTerm

REFERENCE = ("dpo", "ipo", "hinge")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _whole(partial: torch.Tensor) -> torch.Tensor:
    """Rows held whole by one worker: their partial sums are their sums."""
    return partial


def adapter_model(model: torch.nn.Module) -> Any:
    """The PEFT model inside a strategy's wrapper (DDP and DeepSpeed keep it as .module;
    FSDP2 shards it in place)."""
    m: Any = model
    while not hasattr(m, "disable_adapter"):
        m = getattr(m, "module", None)
        if m is None:
            raise TypeError(f"{type(model).__name__} holds no PEFT adapter to switch off")
    return m


class PairObjective:
    """What the objectives over a pair cache share (DPO and its kin, KTO): the feed of
    whole pairs (or labelled rows: `kind`), the reference pass before step 1, the count a
    step averages over, and a micro batch's tensors: ids, labels, the reference column
    when there is one, and each of `extras` (columns after it, by keyword)."""

    kind: type[PairBlocks] = PairBlocks
    extras: tuple[str, ...] = ()
    column_reference: bool = False

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    # ---------------------------------------------------------------- data

    def open_feed(self, train: list[str], eval_: list[str], rank: int, world: int) -> PairFeed:
        return open_pair_feed(self.cfg, train, rank, world, self.kind)

    def before_training(self, strategy: Any, feed: PairFeed, rt: Any) -> None:
        """Full fine-tuning against a reference: its log-probs, computed once (or read)."""
        if self.column_reference:
            from trainer.objectives.reference import ensure_reference

            ensure_reference(self.cfg, strategy, feed.first, rt)

    def count(self, batch: tuple[np.ndarray, ...]) -> int:
        return len(batch[0]) // 2

    def row_logps(self, strategy: Any, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> torch.Tensor:
        """Each row's summed target log-probs from the strategy's forward (inside its
        `evaluating()`): the reference pass's column (trainer.objectives.reference)."""
        return losses.sequence_logps(strategy.logits(x), y)[0]

    def inputs(
        self, batch: tuple[np.ndarray, ...], device: torch.device, attend: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Pairs are never packed: causal attention, and the reference column if any."""
        ids, labels, ref, *extra = batch
        x = torch.from_numpy(ids).to(device, non_blocking=True)
        y = torch.from_numpy(labels).to(device, non_blocking=True)
        kw = {"ref": torch.from_numpy(ref).to(device)} if self.column_reference else {}
        for name, column in zip(self.extras, extra, strict=True):
            kw[name] = torch.from_numpy(np.asarray(column)).to(device)
        return x, y, kw


class Preference(PairObjective):
    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.name = cfg.train.objective
        p = cfg.train.preference
        self.beta, self.gamma, self.smoothing = (
            p.beta_for(self.name),
            p.simpo_gamma,
            p.label_smoothing,
        )
        self.adapter_reference = self.name in REFERENCE and cfg.model.adapter != "none"
        self.column_reference = self.name in REFERENCE and cfg.model.adapter == "none"
        self._sums: torch.Tensor | None = None
        self.router = RouterTerm()
        self._total = _whole  # per-row partial sums → the rows' sums (sp: over the group)

    def split_sequences(self, total: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Under sequence parallelism (trainer.parallel.sequence) each worker holds a share
        of every row: `total` sums per-row partials over the row's workers, with autograd,
        so log-probs, target counts and the reference's are the whole rows' (exact)."""
        self._total = total

    def _row_logps(
        self, logits: torch.Tensor, y: torch.Tensor, shifted: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's summed target log-probs and target count: `y` is the labels, or
        (`shifted`: a share under sequence parallelism) the share's shifted targets."""
        if shifted:
            logps, lens = losses.target_logps(logits, y)
        else:
            logps, lens = losses.sequence_logps(logits, y)
        both = self._total(torch.stack([logps, lens.to(logps.dtype)]))
        return both[0], both[1]

    def row_logps(
        self,
        strategy: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As PairObjective's; under sequence parallelism on this worker's share of every
        row (its global positions, its shifted targets), the sums totalled over the group."""
        at = {} if position_ids is None else {"position_ids": position_ids}
        return self._row_logps(strategy.logits(x, **at), y, shift_labels is not None)[0]

    # ---------------------------------------------------------------- the loss

    def reference_logps(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        ref: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        shifted: bool = False,
    ) -> torch.Tensor:
        """The reference's summed completion log-probs of every row."""
        if ref is not None:
            return ref.float()
        peft = adapter_model(model)
        with torch.no_grad(), peft.disable_adapter():
            logits = model(input_ids=x, position_ids=positions).logits
            return self._row_logps(logits, y, shifted)[0]

    def pair_losses(
        self,
        logps: torch.Tensor,
        lens: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen rewards, rejected rewards, the log-probs TRL logs) from
        every row's summed log-probs and target counts (chosen rows first)."""
        n = len(logps) // 2
        c, r, lc, lr = logps[:n], logps[n:], lens[:n], lens[n:]
        if self.name in REFERENCE:
            assert ref is not None
            out = losses.reference_losses(
                self.name, c, r, ref[:n], ref[n:], lc, lr, self.beta, self.smoothing
            )
            return (*out, logps)
        avg = logps / lens.clamp(min=1)
        if self.name == "simpo":
            out = losses.simpo_losses(avg[:n], avg[n:], self.beta, self.gamma, self.smoothing)
        else:
            out = losses.orpo_losses(avg[:n], avg[n:], self.beta)
        return (*out, avg)

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        num_items: Any,
        ref: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        """The micro batch's pair losses over `num_items`. Under sequence parallelism `x`
        is this worker's share of every row, `y` its shifted targets (`shift_labels`), and
        `position_ids` the share's global positions."""
        shifted = shift_labels is not None
        if self.name in REFERENCE:
            ref = self.reference_logps(model, x, y, ref, position_ids, shifted)
        with self.router.recording(model) as routed:  # a mixture of experts' aux loss
            logits = model(input_ids=x, position_ids=position_ids).logits
        logps, lens = self._row_logps(logits, y, shifted)
        per_pair, chosen, rejected, logged = self.pair_losses(logps, lens, ref)
        self._record(chosen, rejected, logged.detach())
        aux = self.router.term(model, routed, len(chosen), num_items)
        return per_pair.sum() / num_items + aux

    # ---------------------------------------------------------------- metrics

    def _record(self, chosen: torch.Tensor, rejected: torch.Tensor, logged: torch.Tensor) -> None:
        n = len(chosen)
        sums = torch.stack(
            [
                torch.tensor(float(n), device=chosen.device),
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).float().sum(),
                (chosen - rejected).sum(),
                logged[:n].sum(),
                logged[n:].sum(),
            ]
        ).double()
        self._sums = sums if self._sums is None else self._sums + sums

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """TRL's names, each a mean over the pairs trained since the last report, all
        ranks. Collective."""
        local = [0.0] * (1 + len(METRICS)) if self._sums is None else self._sums.tolist()
        self._sums = None
        count, *sums = all_reduce(local)
        aux = self.router.metrics(all_reduce)
        if not count:
            return aux
        return {**{name: s / count for name, s in zip(METRICS, sums, strict=True)}, **aux}
