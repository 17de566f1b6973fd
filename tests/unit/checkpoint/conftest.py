"""The checkpoint tests' model: a two-layer Llama saved once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.small_model import VOCAB


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
