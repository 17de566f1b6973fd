"""MFU counts a mixture-of-experts model's active parameters: the strategy's whole-model
count less the routed experts a token is not sent to (the planner's count, reused), so a
Qwen3-30B-A3B run does not report ~9× its real utilisation. Dense models are unchanged."""

from __future__ import annotations

import pytest
import torch

from tests.unit.model.test_moe_lora import lora_cfg, tiny_moe
from trainer.model import adapters
from trainer.observability.metrics import active_params, mfu


def _routed(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_active_params_drop_the_experts_a_token_is_not_sent_to(kind):
    model = tiny_moe(kind)
    total = sum(p.numel() for p in model.parameters())
    # 4 experts, 2 per token: half of the routed experts' weights are idle for a token.
    assert active_params(total, model) == total - _routed(model) // 2
    # Through wrappers (PEFT; DDP's `module`), adapters counted whole as the strategy does.
    peft = adapters.apply(tiny_moe(kind), lora_cfg(), grew_vocab=False)
    wrapped = torch.nn.ModuleDict({"module": peft})
    n = sum(p.numel() for p in peft.parameters())
    assert n > total
    assert active_params(n, wrapped) == n - _routed(model) // 2


def test_a_dense_model_and_a_module_without_a_config_count_every_parameter():
    from tests.support.small_model import tiny_llama

    model = tiny_llama(0)
    total = sum(p.numel() for p in model.parameters())
    assert active_params(total, model) == total
    assert active_params(123, torch.nn.Linear(2, 2)) == 123


def test_a_30b_a3b_run_reports_mfu_on_its_3_3b_active_parameters():
    from transformers import Qwen3MoeConfig

    conf = Qwen3MoeConfig(  # Qwen3-30B-A3B's config.json
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    holder = torch.nn.Module()
    holder.config = conf  # what the strategy's model carries
    total = 30_532_122_624  # the planner's (and transformers') count on meta
    active = active_params(total, holder)
    assert active == total - 48 * (128 - 8) * 3 * 2048 * 768
    assert active == pytest.approx(3.35e9, rel=0.01)
    # 1,500 tokens/s a device on A10Gs in bf16 (70 TFLOP/s): 43 %, not 392 %.
    assert mfu(active, 1500.0, 70e12) == pytest.approx(6 * active * 1500 / 70e12)
    assert mfu(active, 1500.0, 70e12) == pytest.approx(0.431, abs=0.001)
    assert mfu(total, 1500.0, 70e12) > 3.9
