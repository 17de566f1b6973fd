"""The one interface the loop and the strategies call; each objective implements it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch


class Objective(Protocol):
    name: str

    def open_feed(self, train: list[str], eval_: list[str], rank: int, world: int) -> Any:
        """This rank's feed of micro batches (what a batch is: blocks, or whole pairs)."""

    def before_training(self, strategy: Any, feed: Any, rt: Any) -> None:
        """Whatever must exist before step 1 (a precomputed reference). Collective."""

    def count(self, batch: tuple[np.ndarray, ...]) -> int:
        """The items of a micro batch the step's loss averages over (target tokens, pairs);
        summed over the step and the ranks, the divisor every micro batch's loss gets."""

    def inputs(
        self,
        batch: tuple[np.ndarray, ...],
        device: torch.device,
        attend: Callable[[list[np.ndarray]], dict[str, Any]],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """A micro batch as tensors: (input ids, labels, keyword arguments for `loss`);
        `attend` makes the model's attention arguments from packed documents' segments."""

    def loss(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_items: Any, **kw: Any
    ) -> torch.Tensor:
        """The micro batch's loss, a sum over its items divided by `num_items`, with its
        graph: the strategy runs it under its precision and does the backward."""

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """What the objective measured since the last call, over every rank (collective)."""
