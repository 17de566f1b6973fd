"""SFT: the next-token loss on the data's targets, exactly as the strategies ran it before
objectives were a room (the model's own loss, a token sum over the step's target count).

A mixture-of-experts model also gets its router's load-balancing loss, always (its
coefficient is config.json's `router_aux_loss_coef`; 0 turns it off), whatever its config's
`output_router_logits` says: without it the router collapses onto a few experts. The
model is called with `output_router_logits=False`, so transformers adds nothing itself;
the routers' logits are recorded with hooks on the modules transformers itself records
them from, and the model's own `load_balancing_loss_func` makes the aux loss over the
whole micro batch (a packed batch's 4-D document mask is not the 2-D padding mask that
function takes, and SFT batches carry no padding). Each micro batch's aux loss is weighed
by its share of the step's targets (its count over `num_items`, the step's divisor), so
the step adds coef × the target-weighted mean of the micro batches' aux losses, on any
number of micro batches and ranks, exactly once. It is reported apart as `aux_loss`."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig
from trainer.data.feed import open_feed
from trainer.data.tokenize import IGNORE


class SFT:
    name = "sft"

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self._router: dict[int, RouterAux | None] = {}
        self._aux: list[torch.Tensor] = []  # per micro batch: (aux × targets, targets)

    def open_feed(self, train: list[str], eval_: list[str], rank: int, world: int) -> Any:
        return open_feed(self.cfg, train, eval_, rank, world)

    def before_training(self, strategy: Any, feed: Any, rt: Any) -> None:
        """Nothing to compute before step 1."""

    def count(self, batch: tuple[np.ndarray, ...]) -> int:
        """Predictions the loss averages over: targets after the one-token shift."""
        return int((batch[1][:, 1:] != IGNORE).sum())

    def inputs(
        self,
        batch: tuple[np.ndarray, ...],
        device: torch.device,
        attend: Callable[[list[np.ndarray]], dict[str, Any]],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(input ids, labels, the model's attention arguments: `attend`'s for the packed
        documents' segments, or none)."""
        ids, labels, *segs = batch
        x = torch.from_numpy(ids).to(device, non_blocking=True)
        y = torch.from_numpy(labels).to(device, non_blocking=True)
        return x, y, attend(segs)

    def loss(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_items: Any, **kw: Any
    ) -> torch.Tensor:
        if id(model) not in self._router:
            self._router[id(model)] = RouterAux.find(model)
        router = self._router[id(model)]
        if router is None:
            return model(input_ids=x, labels=y, num_items_in_batch=num_items, **kw).loss
        with router.recording() as logits:
            lm = model(
                input_ids=x,
                labels=y,
                num_items_in_batch=num_items,
                output_router_logits=False,
                **kw,
            ).loss
        aux = router.aux_loss(logits)
        targets = (y[:, 1:] != IGNORE).sum().float()
        share = targets / num_items if num_items is not None else torch.ones_like(targets)
        self._aux.append(torch.stack([aux.detach().float() * targets, targets]))
        return lm + router.coef * aux * share.to(aux.dtype)

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """`aux_loss`: the router's load-balancing loss (before its coefficient), the
        target-weighted mean over the micro batches since the last report, all ranks;
        nothing for a dense model. Collective where the model routes."""
        if not self._aux and not any(self._router.values()):
            return {}
        local = torch.stack(self._aux).sum(0).tolist() if self._aux else [0.0, 0.0]
        self._aux = []
        weighted, targets = all_reduce(local)
        return {"aux_loss": weighted / targets} if targets else {}


class RouterTerm:
    """The router aux loss for an objective that runs the model itself (preference, KTO,
    GRPO): the forwards that train, run inside `recording`, give `term`, coef × their aux
    loss × the micro batch's share of the step (its `count` over `num_items`, the step's
    divisor), so a step adds coef × the count-weighted mean aux loss once, on any number of
    micro batches and ranks, as SFT does with targets. No-grad forwards (a reference, KTO's
    mismatched rows) stay outside. `metrics` reports it apart as `aux_loss`."""

    def __init__(self) -> None:
        self._router: dict[int, RouterAux | None] = {}
        self._aux: list[torch.Tensor] = []  # per micro batch: (aux × count, count)

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
        if id(model) not in self._router:
            self._router[id(model)] = RouterAux.find(model)
        router = self._router[id(model)]
        if router is None:
            yield []
            return
        with router.recording() as logits:
            yield logits

    def term(
        self,
        model: torch.nn.Module,
        logits: list[torch.Tensor],
        count: Any,
        num_items: Any,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | float:
        """The aux term of the forwards `logits` were recorded from (`mask`: their 2-D
        padding mask, as the model was given it)."""
        router = self._router.get(id(model))
        if router is None or not logits:
            return 0.0
        aux = router.aux_loss(logits, mask)
        count = torch.as_tensor(count, dtype=torch.float32, device=aux.device)
        self._aux.append(torch.stack([aux.detach().float() * count, count]))
        return router.coef * aux * (count / num_items).to(aux.dtype)

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """`aux_loss`, the count-weighted mean since the last report over every rank;
        nothing for a dense model. Collective where the model routes."""
        if not self._aux and not any(self._router.values()):
            return {}
        local = torch.stack(self._aux).sum(0).tolist() if self._aux else [0.0, 0.0]
        self._aux = []
        weighted, count = all_reduce(local)
        return {"aux_loss": weighted / count} if count else {}


class RouterAux:
    """A mixture-of-experts causal LM's router auxiliary loss, made from transformers' own
    parts: the router modules its `_can_record_outputs["router_logits"]` names, and the
    `load_balancing_loss_func` of its modeling file."""

    def __init__(self, hf: Any, recorder: Any):
        self.coef = float(hf.router_aux_loss_coef)
        self.experts = int(hf.num_experts)
        self.top_k = int(hf.num_experts_per_tok)
        target = getattr(recorder, "target_class", recorder)
        self.index = getattr(recorder, "index", 0)
        self.routers = [m for m in hf.modules() if isinstance(m, target)]
        # The modeling file of its class (FSDP2 makes a subclass in a module of its own).
        files = [sys.modules.get(c.__module__) for c in type(hf).__mro__]
        self.func = next(
            f.load_balancing_loss_func
            for f in files
            if f is not None and hasattr(f, "load_balancing_loss_func")
        )

    @classmethod
    def find(cls, model: torch.nn.Module) -> RouterAux | None:
        """The router of the causal LM inside `model` (through DDP, PEFT or DeepSpeed
        wrappers), or None for a dense model."""
        for m in model.modules():
            # Its own attributes (a PEFT wrapper forwards them to the model it wraps).
            if "router_aux_loss_coef" in vars(m) and "num_experts_per_tok" in vars(m):
                for inner in m.modules():
                    rec = getattr(type(inner), "_can_record_outputs", None) or {}
                    if "router_logits" in rec:
                        return cls(m, rec["router_logits"])
        return None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """The routers' logits of the forward run inside, layer by layer."""
        out: list[torch.Tensor] = []

        def keep(_m: Any, _args: Any, result: Any) -> None:
            out.append(result[self.index] if isinstance(result, tuple | list) else result)

        hooks = [r.register_forward_hook(keep) for r in self.routers]
        try:
            yield out
        finally:
            for h in hooks:
                h.remove()

    def aux_loss(
        self, logits: list[torch.Tensor], mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """transformers' own loss; `mask` (2-D padding, 1 = a token) leaves pads out."""
        return self.func(tuple(logits), self.experts, self.top_k, mask)
