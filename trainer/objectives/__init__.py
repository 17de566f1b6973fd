"""Training objectives: what a batch is and how its loss is made (SFT's next-token loss,
DPO and its kin), each behind one small interface the loop calls, so a new objective is a
module here and never a branch in the loop. `linear_ce` computes the causal-LM loss
without ever holding a whole batch's logits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import JobConfig


def build_objective(cfg: JobConfig) -> Any:
    """The job's objective: `train.objective`."""
    if cfg.train.objective == "sft":
        from trainer.objectives.sft import SFT

        return SFT(cfg)
    from trainer.objectives.preference import Preference

    return Preference(cfg)
