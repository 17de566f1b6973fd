"""`Strategy.state_nbytes` against figures computed by hand: fp32 AdamW under DDP holds
exactly 16 bytes per parameter (4 weight, 4 grad, 8 for the two moments) plus Adam's
4-byte step counter per parameter tensor; LoRA keeps the frozen base's 4 bytes per
parameter and grads and moments only for the adapters. One process, no Ray; the
sharded strategies are measured by the strategies benchmark (tests/bench)."""

from __future__ import annotations

import torch

from tests.support.small_model import VOCAB, small_strategy


def _step_then_backward(s) -> None:
    """One optimizer step (the moments exist from then on), then a backward: the moment
    at which params, grads and optimizer state are all held."""
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        s.backward(s.model(input_ids=x, labels=x).loss)
        if i == 0:
            s.step()


def test_ddp_fp32_adamw_is_16_bytes_per_parameter(model_dir):
    s = small_strategy(model_dir)
    params = list(s.model.parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    _step_then_backward(s)
    got = s.state_nbytes()
    assert got == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * tensors}
    assert sum(got.values()) == 16 * n + 4 * tensors


def test_lora_counts_the_frozen_base_and_adapter_only_grads_and_moments(model_dir):
    s = small_strategy(model_dir, adapter="lora")
    params = list(s.model.parameters())
    total = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    t = sum(p.numel() for p in trainable)
    assert 0 < t < total / 5
    _step_then_backward(s)
    assert s.state_nbytes() == {
        "params": 4 * total,
        "grads": 4 * t,
        "optimizer": 8 * t + 4 * len(trainable),
    }
