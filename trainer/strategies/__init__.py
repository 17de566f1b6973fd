"""Strategies: how a model is wrapped for data parallelism, and how it is saved and loaded.

A strategy knows nothing about data, Ray or storage. The loop calls exactly the methods
of `Strategy`; adding FSDP2 or DeepSpeed means adding a module that implements them and a
line in `_REGISTRY`, not touching the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch


class Strategy(Protocol):
    name: str

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Return the model ready for training (moved, wrapped or sharded)."""

    def unwrap(self, model: torch.nn.Module) -> Any:
        """The underlying Hugging Face model (for config, generation, export)."""

    def build_optimizer(
        self, model: torch.nn.Module, groups: list[dict[str, Any]], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """An optimizer over the wrapped model's parameter groups."""

    def no_sync(self, model: torch.nn.Module, last_micro_step: bool) -> AbstractContextManager:
        """Skip gradient synchronisation on all but the last micro step of an accumulation."""

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float | None) -> float:
        """Clip (if max_norm) and return the global gradient norm."""

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        out: Path,
        rank: int,
        tokenizer: Any,
    ) -> None:
        """Write model (HF format, under out/'model'), and optimizer state into `out`."""

    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path, rank: int
    ) -> None:
        """Restore model and optimizer state written by `save` (same strategy)."""


def get_strategy(name: str, world_size: int) -> Strategy:
    from trainer.strategies.ddp import DDPStrategy

    registry = {"ddp": DDPStrategy}
    if name not in registry:
        raise ValueError(f"train.strategy: unknown strategy {name!r}")
    return registry[name](world_size)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices, not biases or norm weights (the usual LLM recipe)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
