"""Strategies: everything that differs between data-parallel schemes, behind one seam.

A strategy builds the model from the model source (plain load for DDP, meta-device
skeleton + sharded load for FSDP2, a 4-bit load for QLoRA), its optimizer and its
precision context; it runs backward and the optimizer step (clipping included, returning
the grad norm); it saves and loads its own resume state; and it writes the user's export
(a plain Hugging Face folder, or a PEFT adapter folder). It runs the model for the loop
(`train_micro`, `eval_loss`, `logits`), so a pipeline's stages stay its own business.
The loop calls exactly the methods of `Strategy` and never asks which one it has; adding
one means a module that implements them and a line in `IMPLEMENTATIONS`.

A strategy knows nothing about data, Ray or storage: it reads and writes local folders.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.config import JobConfig


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from and what the tokenizer needs of them."""

    model_dir: Path
    vocab_size: int


class Strategy(Protocol):
    name: str
    layout: str
    """Resume-state layout id, recorded in every checkpoint; a different one is refused."""

    model: torch.nn.Module
    """The module the loop calls forward on (wrapped or sharded)."""

    optimizer: torch.optim.Optimizer

    def setup(self, source: ModelSource) -> None:
        """Build the model from `source` and the optimizer over it."""

    def precision(self) -> AbstractContextManager:
        """The context forward passes run in (autocast, or a null context)."""

    def accumulating(self, last_micro_step: bool) -> AbstractContextManager:
        """Skip gradient synchronisation on all but the last micro step."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def train_micro(
        self, x: torch.Tensor, y: torch.Tensor, num_items: Any, **attention: Any
    ) -> torch.Tensor:
        """Forward and backward of one micro batch (under `accumulating`); its loss, a
        token sum over `num_items`, detached, the same on every rank of a model replica.
        A pipelined strategy runs its whole schedule here."""

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, **attention: Any) -> float:
        """Mean loss over the batch's target tokens (inside `evaluating()`)."""

    def logits(self, x: torch.Tensor, **attention: Any) -> torch.Tensor:
        """Logits for `x` on every rank (inside `evaluating()`)."""

    def step(self) -> torch.Tensor | float:
        """Clip (if configured), step the optimizer, zero the grads; the global grad norm
        (a 0-dim tensor may stay on the device: the step report reads it when due)."""

    def param_count(self) -> int:
        """The whole model's parameters (every pipeline stage, every shard), the same on
        every rank: what MFU counts. Collective where the model is split into stages."""

    def evaluating(self) -> AbstractContextManager:
        """Eval mode and no grad for the duration, train mode after."""

    def save_state(self, out: Path, rank: int) -> None:
        """Write this rank's part of the resume state (model + optimizer) under `out`."""

    def load_state(self, ckpt: Path, rank: int) -> None:
        """Restore what `save_state` wrote (possibly by a different world size)."""

    def export(self, out: Path, rank: int, tokenizer: Any) -> bool:
        """Write the user's export under `out`; True on the rank(s) that wrote files.
        Collective: every rank calls it."""

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of training state THIS rank holds, by kind: `params`, `grads`,
        `optimizer` (master weights included), each storage counted once, in whatever
        memory holds it (device, or CPU when offloaded). Called between backward and
        step, it is the state at its peak; activations and transient buffers are not in
        it (a process's peak RSS or peak device memory is where those show)."""


# strategy.name → the module and class that implement it, imported when a job uses it: the
# seam sits below its strategies and imports none of them (each imports ModelSource from
# here). A new strategy is a line here and a module beside this file.
IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "ddp": ("trainer.strategies.ddp", "DDPStrategy"),
    "fsdp": ("trainer.strategies.fsdp", "FSDPStrategy"),
    "deepspeed": ("trainer.strategies.deepspeed.engine", "DeepSpeedStrategy"),
}


def build_strategy(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> Strategy:
    """The job's strategy, its module imported only now (DeepSpeed's only where it runs)."""
    name = cfg.strategy.name
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"strategy.name: unknown strategy {name!r}")
    module, cls = IMPLEMENTATIONS[name]
    return getattr(importlib.import_module(module), cls)(cfg, device, world_size)


def param_groups(
    model: torch.nn.Module, weight_decay: float, keep_empty: bool = True
) -> list[dict[str, Any]]:
    """Decay matrices, not biases or norm weights (the usual LLM recipe). A ZeRO-3
    parameter is an empty placeholder on every rank (its partition is elsewhere), so
    its shape is DeepSpeed's `ds_shape`, not the placeholder's. Adapters have only
    matrices: `keep_empty=False` drops the empty group, which DCP's flattened optimizer
    state and ZeRO cannot load (DDP keeps it: its adapter checkpoints hold two groups)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if keep_empty or g["params"]]
