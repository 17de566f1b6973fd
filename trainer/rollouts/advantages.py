"""Advantages from a batch's rewards: GRPO's group-relative ones and RLOO's leave-one-out.

`rewards` is the whole step's, every rank's completions in order, each prompt's
`num_generations` completions side by side, as TRL gathers them before it normalises;
a rank keeps its own slice afterwards. Standard deviations are Bessel-corrected (TRL's
nanstd), and 1e-4 keeps a group whose completions all scored the same at advantage 0.
"""

from __future__ import annotations

import torch


def _std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return x.std(dim=dim, correction=1) if dim is not None else x.std(correction=1)


def grpo_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """(r - the group's mean) / (the group's or the batch's std + 1e-4); `none` keeps
    the difference (Dr. GRPO)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    advantages = rewards - mean
    if scale == "none":
        return advantages
    std = _std(grouped, 1).repeat_interleave(group) if scale == "group" else _std(rewards)
    return advantages / (std + 1e-4)


def rloo_advantages(
    rewards: torch.Tensor,
    group: int,
    normalize: bool,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """r - the mean of the group's other completions; with beta > 0 each reward first
    loses beta × its completion's summed log-ratio to the reference (RLOO's KL penalty).
    `normalize`: then standardised over the batch."""
    if kl is not None and beta != 0.0:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, group)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group - 1)
    advantages = (grouped - baseline).reshape(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (_std(advantages) + 1e-4)
    return advantages
