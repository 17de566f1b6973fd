"""GRPO's group-relative and RLOO's leave-one-out advantages, on rewards worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.rollouts.advantages import grpo_advantages, rloo_advantages

# two prompts, four completions each
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)


def test_grpo_group_scale() -> None:
    adv = grpo_advantages(REWARDS, 4, "group")
    std = math.sqrt(1 / 3)  # Bessel-corrected: sum of squares 1, over n - 1 = 3
    a = 0.5 / (std + 1e-4)
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[4:].tolist() == [0.0] * 4  # one score for the whole group: no signal


def test_grpo_batch_scale_and_none() -> None:
    std = float(REWARDS.std())  # over the whole batch, the group's mean still subtracted
    assert grpo_advantages(REWARDS, 4, "batch")[0] == pytest.approx(0.5 / (std + 1e-4))
    assert grpo_advantages(REWARDS, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_rloo_leave_one_out() -> None:
    r = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    # baselines: mean of the others: 0, 1.5, 1.5
    assert rloo_advantages(r, 3, normalize=False).tolist() == [3.0, -1.5, -1.5]
    kl = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    # rewards after the KL penalty (beta 0.5): 2.5, 0, 0.5
    assert rloo_advantages(r, 3, False, kl, beta=0.5).tolist() == [2.25, -1.5, -0.75]
    norm = rloo_advantages(r, 3, normalize=True)
    assert float(norm.mean()) == pytest.approx(0.0) and float(norm.std()) == pytest.approx(
        1.0, rel=1e-3
    )
