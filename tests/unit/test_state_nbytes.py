"""`Strategy.state_nbytes` against figures computed by hand: fp32 AdamW under DDP holds
exactly 16 bytes per parameter (4 weight, 4 grad, 8 for the two moments) plus Adam's
4-byte step counter per parameter tensor; LoRA keeps the frozen base's 4 bytes per
parameter and grads and moments only for the adapters. One process, no Ray; the
sharded strategies are measured by the strategies benchmark (tests/bench)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy

VOCAB = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(conf).save_pretrained(out, safe_serialization=True)
    return out


def _strategy(model_dir: Path, adapter: str = "none"):
    cfg = load_config(
        {
            "model": {"path": str(model_dir), "adapter": adapter},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "nbytes"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, VOCAB))
    s.model.train()
    return s


def _step_then_backward(s) -> None:
    """One optimizer step (the moments exist from then on), then a backward: the moment
    at which params, grads and optimizer state are all held."""
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        s.backward(s.model(input_ids=x, labels=x).loss)
        if i == 0:
            s.step()


def test_ddp_fp32_adamw_is_16_bytes_per_parameter(model_dir):
    s = _strategy(model_dir)
    params = list(s.model.parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    _step_then_backward(s)
    got = s.state_nbytes()
    assert got == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * tensors}
    assert sum(got.values()) == 16 * n + 4 * tensors


def test_lora_counts_the_frozen_base_and_adapter_only_grads_and_moments(model_dir):
    s = _strategy(model_dir, adapter="lora")
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
