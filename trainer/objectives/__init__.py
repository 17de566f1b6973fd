"""Training objectives: what a batch is and how its loss is made (SFT's next-token loss,
DPO and its kin), each behind one small interface the loop calls, so a new objective is a
module here and never a branch in the loop. `linear_ce` computes the causal-LM loss
without ever holding a whole batch's logits."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import JobConfig


# train.objective → the module and class that implement it. A new objective is a line here
# and a module beside this file; the loop and the strategies only call the interface.
IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "sft": ("trainer.objectives.sft", "SFT"),
    "dpo": ("trainer.objectives.preference", "Preference"),
    "ipo": ("trainer.objectives.preference", "Preference"),
    "hinge": ("trainer.objectives.preference", "Preference"),
    "simpo": ("trainer.objectives.preference", "Preference"),
    "orpo": ("trainer.objectives.preference", "Preference"),
    "kto": ("trainer.objectives.kto", "KTO"),
    "grpo": ("trainer.objectives.grpo", "GRPO"),
    "rloo": ("trainer.objectives.grpo", "GRPO"),
}


def build_objective(cfg: JobConfig) -> Any:
    """The job's objective: `train.objective`, imported only when a job uses it."""
    module, name = IMPLEMENTATIONS[cfg.train.objective]
    return getattr(importlib.import_module(module), name)(cfg)
