"""SFT: the next-token loss on the data's targets, exactly as the strategies ran it before
objectives were a room (the model's own loss, a token sum over the step's target count)."""

from __future__ import annotations

from collections.abc import Callable
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
        return model(input_ids=x, labels=y, num_items_in_batch=num_items, **kw).loss

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        return {}
