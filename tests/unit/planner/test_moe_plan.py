"""The planner knows a mixture-of-experts model's total against active parameters: memory
counts all of them, FLOPs (and so the throughput estimate) only those a token is routed
through; LoRA's count includes the adapters on the fused experts. Counts are held against
transformers' own models built on the meta device from the configs (no weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.planner.plan import flops_per_token
from trainer.planner.shape import ModelShape

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def meta_count(conf: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**conf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_is_30_5b_total_and_3_3b_active():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert shape.params == meta_count(QWEN3_30B_A3B)  # transformers' own count, exactly
    assert shape.params == pytest.approx(30.5e9, rel=0.01)
    assert shape.active_params == pytest.approx(3.35e9, rel=0.01)  # published: 3.3B
    expert = 3 * 2048 * 768  # one expert's gate, up and down
    assert shape.params - shape.active_params == 48 * (128 - 8) * expert
    full = flops_per_token(shape, SimpleNamespace(adapter="none", checkpointing=False))
    assert full == 6.0 * shape.active_params


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize(
    "conf",
    [
        {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, **TINY},
        {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, **TINY},
        {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **TINY},
    ],
    ids=["qwen3_moe", "qwen2_moe", "mixtral"],
)  # fmt: skip
def test_total_and_lora_counts_are_transformers_and_peft_counts(conf):
    from tests.unit.model.test_moe_lora import lora_cfg
    from trainer.model import adapters

    shape = ModelShape.from_hf_config(conf)
    assert shape.params == meta_count(conf)
    assert shape.active_params < shape.params
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**conf))
    peft = adapters.apply(model, lora_cfg(), grew_vocab=False)
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert shape.lora_params(4, "auto") == trainable
    assert shape.lora_params(4, ["q_proj", "v_proj"]) < trainable  # no expert adapters


def test_a_dense_model_is_all_active():
    from trainer.planner.shape import LLAMA2_7B_CONFIG

    shape = ModelShape.from_hf_config(LLAMA2_7B_CONFIG)
    assert shape.experts == 0 and shape.active_params == shape.params
