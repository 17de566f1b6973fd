"""The `generate` rollout engine: transformers' `generate` on the training worker, with
the policy's weights as the strategy holds them, a worker's prompts in one call.

Sampling is seeded per (run seed, rollout, rank), from a forked RNG: a resumed step gives
each worker the same prompts (the feed is a function of the step; the worker count is
fixed for RL), so it regenerates the same completions, and the training RNG streams
(dropout, data order) are left exactly where they were. One call per worker, prompts
left-padded as TRL pads a generation batch: on CPU a call per prompt's group cost 4-6
times the decoding steps for a few prompts a worker.

Under FSDP2 and ZeRO-3 the forward is collective (each layer's shards are gathered as it
runs), so every rank must run the same number of decoding steps: `synced` passes
transformers' `synced_gpus`, which keeps a rank that finished decoding in step (forwards
without output) until every rank has. The weights are used as they are, never copied.
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


def sample_seed(seed: int, rollout: int, rank: int) -> int:
    """The seed of one worker's rollout: independent streams per (run, rollout, rank)."""
    return int(np.random.SeedSequence([seed, rollout, rank]).generate_state(1)[0])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module that has `generate` inside a strategy's wrapper (DDP and DeepSpeed keep
    it as .module); a PEFT model generates through its adapter."""
    m: Any = model
    while not hasattr(m, "generate") and hasattr(m, "module"):
        m = m.module
    return m


class GenerateEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        sampling: Sampling,
        device: torch.device,
        synced: bool = False,
    ):
        self.model, self.s, self.device, self.synced = model, sampling, device, synced

    def sample(self, prompts: list[list[int]], n: int, seed: int) -> list[list[int]]:
        """`n` completions of each prompt (prompt-major: a prompt's group side by side),
        each cut after its first EOS (kept: the model must learn to stop); one without
        EOS has max_new_tokens tokens (truncated). One `generate` call over the prompts,
        left-padded as the training batch pads them."""
        model = unwrap(self.model)
        width = max(len(p) for p in prompts)
        x = torch.full((len(prompts), width), self.s.pad_id, dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, p in enumerate(prompts):
            x[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                out = model.generate(
                    input_ids=x.to(self.device),
                    attention_mask=mask.to(self.device),
                    do_sample=True,
                    temperature=self.s.temperature,
                    top_p=self.s.top_p,
                    top_k=0,
                    max_new_tokens=self.s.max_new_tokens,
                    num_return_sequences=n,
                    eos_token_id=self.s.eos_id,
                    pad_token_id=self.s.pad_id,
                    synced_gpus=self.synced,
                )
        finally:
            model.train(was_training)
        return [_cut(row, self.s.eos_id) for row in out[:, width:].tolist()]


def _cut(ids: list[int], eos: int) -> list[int]:
    with contextlib.suppress(ValueError):
        return ids[: ids.index(eos) + 1]
    return ids
