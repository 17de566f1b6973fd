"""A strategy built on a small saved Llama (the checkpoint tests' `model_dir` fixture)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy

VOCAB = 96
"""The small model's vocabulary."""


def tiny_llama(seed: int, vocab: int = VOCAB, **config: object) -> torch.nn.Module:
    """An in-memory Llama of 2 layers, hidden 32 (4 heads, 2 KV heads), fp32, its weights
    drawn after torch.manual_seed(seed); `config` adds LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **config,
    )
    return LlamaForCausalLM(conf).float()


def small_strategy(model_dir: Path, adapter: str = "none"):
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
