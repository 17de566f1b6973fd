"""What a preference objective adds to a plan: pairs are two sequences each (the memory
side is `Setup.micro_batch`, in sequences), the reference's price, and what a live
reference model, the one Raylift never loads, would have cost instead.

Pure arithmetic over the shape and the setup, like the rest of the planner: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config import JobConfig

REFERENCE_OBJECTIVES = ("dpo", "ipo", "hinge", "kto")
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
NF4_BYTES = 0.5 + 4 / 64
"""4 bits a weight and an fp32 absmax per block of 64 (before double quantization)."""
GIB = 1024**3


@dataclass(frozen=True)
class PreferenceCost:
    objective: str
    reference: str
    """none (simpo, orpo), adapter_off (lora/qlora) or precomputed (full fine-tuning)."""
    pairs_per_step: int
    sequences_per_step: int
    forward_share: float
    """One forward pass's share of a training step's FLOPs (2·M of the step's per token)."""
    prepass_s: float | None
    """The reference pass before step 1 (precomputed only; None without a throughput)."""
    step_overhead: float
    """Extra compute per step, as a share of a step (adapter_off: one more forward)."""
    live_reference_gib_per_rank: float
    """A second, frozen model's weights per rank (sharded where the strategy shards)."""
    live_reference_s: float | None
    """A live reference model's extra forwards over one epoch (None without a throughput)."""


def flops_factor(adapter: str, checkpointing: bool) -> float:
    """Training FLOPs per token per parameter (trainer.planner.plan.flops_per_token's)."""
    return (4.0 if adapter != "none" else 6.0) + (2.0 if checkpointing else 0.0)


def reference_weight_bytes(params: int, setup: Any) -> float:
    """A frozen copy of the model on one rank: compute-dtype weights (4-bit under qlora),
    split over the ranks by a strategy that shards parameters."""
    per_param = NF4_BYTES if setup.adapter == "qlora" else BYTES[setup.precision]
    sharded = setup.strategy in ("fsdp", "zero3")
    return params * per_param / (setup.world if sharded else 1)


def cost(
    cfg: JobConfig,
    params: int,
    setup: Any,
    tokens_per_s: float | None,
    tokens_per_epoch: int | None,
) -> PreferenceCost | None:
    """None for SFT. `tokens_per_s` is the whole layout's training throughput and
    `tokens_per_epoch` counts both sequences of every pair."""
    objective = cfg.train.objective
    if objective in ("sft", "grpo", "rloo"):  # online RL: trainer.planner.rollouts
        return None
    if objective not in REFERENCE_OBJECTIVES:
        reference = "none"
    else:
        reference = "adapter_off" if cfg.model.adapter != "none" else "precomputed"
    share = 2.0 / flops_factor(setup.adapter, setup.checkpointing)
    epoch_s = tokens_per_epoch / tokens_per_s if tokens_per_s and tokens_per_epoch else None
    return PreferenceCost(
        objective=objective,
        reference=reference,
        pairs_per_step=cfg.global_batch,
        sequences_per_step=cfg.global_batch * cfg.sequences_per_example,
        forward_share=share,
        prepass_s=epoch_s * share if epoch_s is not None and reference == "precomputed" else None,
        step_overhead=share if reference == "adapter_off" else 0.0,
        live_reference_gib_per_rank=reference_weight_bytes(params, setup) / GIB,
        live_reference_s=epoch_s * share if epoch_s is not None else None,
    )


def notes(c: PreferenceCost | None) -> list[str]:
    """The plan's lines for a preference objective."""
    if c is None:
        return []
    if c.objective == "kto":
        out = [
            f"kto: {c.pairs_per_step} rows per step = {c.sequences_per_step} sequences (each "
            "row's and its mismatched one for the KL estimate, a no-grad forward; memory and "
            "tokens count both)"
        ]
    else:
        out = [
            f"{c.objective}: {c.pairs_per_step} pairs per step = {c.sequences_per_step} "
            "sequences (chosen and rejected; memory and tokens count both)"
        ]
    live = (
        f"a live reference model would add {c.live_reference_gib_per_rank:.2f} GiB per rank "
        "(its frozen weights)"
        + (f" and {_duration(c.live_reference_s)} per epoch" if c.live_reference_s else "")
    )
    if c.reference == "precomputed":
        when = f"~{_duration(c.prepass_s)}" if c.prepass_s is not None else "one forward pass"
        out.append(
            f"reference: log-probs precomputed before step 1 ({when} over the data, "
            f"{c.forward_share:.0%} of an epoch's compute; read back on a resume); {live}"
        )
    elif c.reference == "adapter_off":
        out.append(
            "reference: the base with the adapter off, one more forward per micro batch "
            f"(+{c.step_overhead:.0%} compute, no memory); {live}"
        )
    else:
        out.append(f"reference: none ({c.objective} compares the policy's own log-probs)")
    return out


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
