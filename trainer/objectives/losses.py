"""The preference losses, as plain functions of per-sequence completion log-probs.

Each returns per-pair losses (a pair's share of the batch mean, before the divisor) and
the rewards TRL logs for it, so a step's loss is the mean over every pair of the global
batch however the pairs are split into micro batches and ranks. The formulas are TRL's
(DPOTrainer: sigmoid, hinge, ipo; CPOTrainer: simpo; ORPOTrainer: orpo), checked against
TRL itself in tests/unit/test_objectives_trl.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.data.tokenize import IGNORE


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's target tokens, their count), the one-token shift
    done as a causal LM's loss does it. The log-softmax runs in float32."""
    return target_logps(logits[:, :-1], labels[:, 1:])


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` on targets already shifted (position i's target is the token after
    i): what a share of a sequence under sequence parallelism holds, its last position's
    target being the next share's first token."""
    mask = targets != IGNORE
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    return (per_token * mask).sum(-1), mask.sum(-1)


def _smoothed(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(z), with the conservative DPO label smoothing."""
    return -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing


def reference_losses(
    kind: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dpo (TRL's `sigmoid`), hinge and ipo on summed log-probs; (losses, chosen
    rewards, rejected rewards), the rewards beta × the log-ratio to the reference."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if kind == "dpo":
        losses = _smoothed(beta * delta, label_smoothing)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif kind == "ipo":
        # IPO's squared loss on log-ratios averaged per completion token (TRL's
        # normalisation, agreed with the IPO authors); beta is the paper's tau.
        per_token = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(
            min=1
        )
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"not a reference loss: {kind}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_losses(
    chosen_avg: torch.Tensor,
    rejected_avg: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO on length-averaged log-probs, no reference: -log sigmoid(beta Δ - gamma)."""
    losses = _smoothed(beta * (chosen_avg - rejected_avg) - gamma, label_smoothing)
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(
        x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x))
    )


def orpo_losses(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO on length-averaged log-probs: the chosen completion's mean NLL minus lambda ×
    log sigmoid(log odds ratio). The NLL is per pair (its chosen tokens' mean), so a
    batch's loss is a mean over pairs; TRL's ORPOTrainer takes a token mean over the
    batch's chosen rows (and counts prompt tokens in it), which differs when lengths do."""
    chosen_avg, rejected_avg = chosen_avg.float(), rejected_avg.float()
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
    losses = -chosen_avg - beta * F.logsigmoid(log_odds)
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()
