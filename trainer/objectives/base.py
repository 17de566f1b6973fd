"""The one interface the loop and the strategies call; each objective implements it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

UPDATE_TOKENS = "tokens/update"
"""An objective whose step is not `train.tokens_per_step` tokens (online RL: prompts and
sampled completions of any length) reports the real tokens its update ran forward and
backward since the last report, summed over ranks; tokens_per_s and MFU then count those
instead of global batch x block size (MFU stays 6·N per update token: generation's
forwards are not in it, so an RL run's MFU is the update's share of the step's time)."""

TABLES = "tables"
"""An objective's rows for the trackers' tables ({name: [row, ...]}, rank 0's sample):
sent to each tracker at the step and kept out of the metrics record."""


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
