"""Per-token log-probs of completions: what the loss differentiates, and what a rollout
keeps from sampling time and from the reference (the objective and the rollout share it,
so both score a completion the same way)."""

from __future__ import annotations

import torch


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
