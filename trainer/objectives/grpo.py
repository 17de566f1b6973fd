"""Online RL objectives: GRPO (with its Dr. GRPO, DAPO and BNPO normalisations) and RLOO.

A micro batch is completions the rollout (trainer.rollouts) already sampled, scored and
turned into advantages, with the log-probs of sampling time (`old`, when the ratio needs
them) and of the reference (`ref`, when beta > 0). Its loss is the clipped policy loss
over the completion tokens, each loss type's sum over the divisor `count` makes it, so a
step's gradient is TRL's (GRPOTrainer / RLOOTrainer) however the completions are split
into micro batches and ranks: dapo divides by the step's completion tokens over every
rank, grpo and dr_grpo by its completions, bnpo by each micro batch's own tokens (one
count per micro batch), rloo by its completions. tests/unit/rl checks it against TRL.

The per-token log-probs are the model's own logits at the completion positions over the
sampling temperature, as TRL scores them; entropy comes from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig

BATCH = ("ids", "attention", "loss_mask", "advantages", "old", "ref")
"""A micro batch's arrays, in order: prompt + completion ids (prompts left-padded,
completions right-padded), their attention mask, the completion tokens the loss counts,
one advantage per completion, the sampling-time and the reference log-probs (per token;
for rloo `old` is per completion; empty arrays of width 0 when not needed)."""


@dataclass(frozen=True)
class LossSettings:
    """What the loss needs from train.rl, resolved once."""

    objective: str
    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    max_completion_length: int
    temperature: float

    @classmethod
    def of(cls, cfg: JobConfig) -> LossSettings:
        rl = cfg.train.rl
        return cls(
            objective=cfg.train.objective,
            loss_type=rl.loss_type if cfg.train.objective == "grpo" else "rloo",
            beta=rl.beta_for(cfg.train.objective),
            epsilon_low=rl.epsilon,
            epsilon_high=rl.clip_high,
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
        )


def completion_logps(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    width: int,
    temperature: float,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each of the last `width` tokens, their entropies or None): logits only
    for those positions (`logits_to_keep`), divided by the temperature, softmax in float32 at least.
    A completion position the attention mask leaves out scores 0, as in TRL."""
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=width + 1).logits
    logits = logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    target = ids[:, -width:]
    logps = torch.gather(logp_all, -1, target.unsqueeze(-1)).squeeze(-1)
    keep = attention[:, -width:] != 0
    logps = logps.masked_fill(~keep, 0.0)
    if not entropy:
        return logps, None
    ent = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~keep, 0.0)
    return logps, ent


def count_items(loss_type: str, loss_mask: np.ndarray) -> float:
    """A micro batch's share of the step's divisor (see the module docstring)."""
    if loss_type == "dapo":
        return float(loss_mask.sum())
    if loss_type == "bnpo":
        return 1.0
    return float(len(loss_mask))


def policy_loss(
    s: LossSettings,
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    num_items: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro batch's loss over `num_items`, sums for the metrics) from per-token
    log-probs with their graph. `old` None: the ratio is against these log-probs detached
    (one update per rollout); `ref` None: no KL term."""
    mask = mask.to(logps.dtype)
    if s.loss_type == "rloo":
        return _rloo_loss(s, logps, mask, advantages, old, num_items)
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    stats: dict[str, torch.Tensor] = {}
    if s.beta != 0.0:
        assert ref is not None, "beta > 0 needs the reference log-probs"
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + s.beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    masked = per_token * mask
    if s.loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_items
    elif s.loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / num_items
    elif s.loss_type == "dr_grpo":
        loss = masked.sum() / (num_items * s.max_completion_length)
    elif s.loss_type == "dapo":
        loss = masked.sum() / num_items
    else:
        raise ValueError(f"unknown loss_type {s.loss_type!r}")
    low = ((ratio < 1 - s.epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + s.epsilon_high) & (adv > 0)).to(mask.dtype)
    stats["clip_low"] = (low * mask).sum()
    stats["clip_high"] = (high * mask).sum()
    stats["clip_region"] = (torch.clamp(low + high, max=1.0) * mask).sum()
    stats["clip_count"] = mask.sum()
    return loss, stats


def _rloo_loss(
    s: LossSettings,
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    num_items: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO: one clipped ratio per completion (its summed log-probs against sampling
    time's); the KL is already in the advantages, as a reward penalty."""
    seq = (logps * mask).sum(1)
    old_seq = seq.detach() if old is None or old.numel() == 0 else old.reshape(-1)
    ratio = torch.exp(seq - old_seq)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).sum() / num_items
    low = ((ratio < 1 - s.epsilon_low) & (advantages < 0)).to(seq.dtype)
    high = ((ratio > 1 + s.epsilon_high) & (advantages > 0)).to(seq.dtype)
    n = torch.tensor(float(len(seq)), dtype=seq.dtype, device=seq.device)
    return loss, {
        "clip_low": low.sum(),
        "clip_high": high.sum(),
        "clip_region": torch.clamp(low + high, max=1.0).sum(),
        "clip_count": n,
    }
