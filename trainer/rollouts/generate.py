"""The `generate` rollout engine: transformers' `generate` on the training worker, with
the policy's weights as the strategy holds them, each prompt's group sampled in one call.

Sampling is seeded per (run seed, rollout, prompt), from a forked RNG, so a resumed step
regenerates the same completions and the training RNG streams (dropout, data order) are
left exactly where they were. A prompt's group is one `generate` call with no padding, so
a completion never depends on which other prompts share its worker or micro batch.

Strategies whose forward is collective (FSDP2's per-layer all-gathers, ZeRO-3's
partitions) would need every rank to run the same number of decoding steps; this build
refuses them for the RL objectives (trainer.config.job), so the model here is whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    eos_id: int
    pad_id: int


def sample_seed(seed: int, rollout: int, prompt: int) -> int:
    """The seed of one prompt's group: independent streams per (run, rollout, prompt)."""
    return int(np.random.SeedSequence([seed, rollout, prompt]).generate_state(1)[0])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module that has `generate` inside a strategy's wrapper (DDP and DeepSpeed keep
    it as .module); a PEFT model generates through its adapter."""
    m: Any = model
    while not hasattr(m, "generate") and hasattr(m, "module"):
        m = m.module
    return m


class GenerateEngine:
    def __init__(self, model: torch.nn.Module, sampling: Sampling, device: torch.device):
        self.model, self.s, self.device = model, sampling, device

    def sample(self, prompt_ids: list[int], n: int, seed: int) -> list[list[int]]:
        """`n` completions of one prompt, each cut after its first EOS (kept: the model
        must learn to stop); one without EOS has max_new_tokens tokens (truncated)."""
        model = unwrap(self.model)
        x = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                out = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    do_sample=True,
                    temperature=self.s.temperature,
                    top_p=self.s.top_p,
                    top_k=0,
                    max_new_tokens=self.s.max_new_tokens,
                    num_return_sequences=n,
                    eos_token_id=self.s.eos_id,
                    pad_token_id=self.s.pad_id,
                )
        finally:
            model.train(was_training)
        return [_cut(row, self.s.eos_id) for row in out[:, x.shape[1] :].tolist()]


def _cut(ids: list[int], eos: int) -> list[int]:
    with contextlib.suppress(ValueError):
        return ids[: ids.index(eos) + 1]
    return ids
