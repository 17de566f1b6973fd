"""Mixture-of-experts models under LoRA: the default targets reach the routed experts.

In transformers 5 the routed experts are fused 3-D parameters, not Linear modules, so
module targets alone give an adapter that trains attention only. These tests build tiny
random models from their configs (4 experts, 2 per token, 2 layers; nothing from a hub)
and fail if `model.lora.target_modules: auto` leaves an expert without an adapter."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.model import adapters, families

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def tiny_moe(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random MoE causal LM of the family `kind`, fp32, weights from `seed`."""
    import transformers as tf

    if kind == "qwen3_moe":
        conf = tf.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **SHAPE
        )
    elif kind == "qwen2_moe":
        conf = tf.Qwen2MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **SHAPE,
        )
    else:
        conf = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SHAPE)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(conf).float()


def lora_cfg(targets: object = "auto"):
    return load_config(
        {
            "model": {
                "path": "unused",
                "adapter": "lora",
                "lora": {"r": 4, "alpha": 8, "target_modules": targets},
            },
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "moe"},
        }
    )


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_default_lora_targets_train_the_routed_experts(kind, caplog):
    model = tiny_moe(kind)
    n_experts = 4
    with caplog.at_level(logging.INFO, logger="trainer.model.adapters"):
        peft = adapters.apply(model, lora_cfg(), grew_vocab=False)
    kinds = adapters.trainable_by_kind(peft)
    r, hidden = 4, 32
    # Every layer's two fused projections get A (r·experts × in) and B (out × r·experts).
    conf = peft.config
    inter = conf.moe_intermediate_size if kind != "mixtral" else conf.intermediate_size
    per_layer = r * n_experts * ((hidden + 2 * inter) + (inter + hidden))
    assert kinds["experts"] == 2 * per_layer
    assert kinds["attention"] == 2 * r * (4 * hidden + 32 + 16 + 16 + 32)
    assert ("shared" in kinds) == (kind == "qwen2_moe")
    assert "router" not in kinds  # the router stays frozen (the aux loss balances it)
    assert f"experts {kinds['experts']:,}" in caplog.text
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    peft(input_ids=x, labels=x).loss.backward()
    for layer in range(2):
        grads = [
            p.grad
            for n, p in peft.named_parameters()
            if f"layers.{layer}.mlp.experts" in n and ".lora_B." in n
        ]
        assert len(grads) == 2, (layer, grads)
        assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_the_families_table_gives_experts_as_target_parameters():
    for mt in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        conf = {"model_type": mt}
        assert families.resolve_parameters("auto", conf) == families.FUSED_EXPERTS
        assert families.resolve_parameters(["q_proj"], conf) == ()
        assert "q_proj" in families.resolve_targets("auto", conf)
        assert "routed experts" in families.describe_targets("auto", conf)
    assert families.resolve_targets("auto", {"model_type": "mixtral"}) == (
        families.ATTENTION_LINEARS
    )
    assert families.resolve_parameters("auto", {"model_type": "llama"}) == ()


def test_explicit_modules_leave_the_experts_out_and_the_log_shows_it(caplog):
    with caplog.at_level(logging.INFO, logger="trainer.model.adapters"):
        peft = adapters.apply(tiny_moe("mixtral"), lora_cfg(["q_proj", "v_proj"]), False)
    assert "experts" not in adapters.trainable_by_kind(peft)
    assert "attention" in caplog.text and "experts" not in caplog.text


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_adapter_export_loads_with_plain_peft_and_gives_the_same_logits(kind, tmp_path: Path):
    from peft import PeftModel

    peft = adapters.apply(tiny_moe(kind), lora_cfg(), grew_vocab=False)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for n, p in peft.named_parameters():
            if adapters.is_adapter_weight(n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft.save_pretrained(str(tmp_path / "adapter"))
    x = torch.randint(0, 64, (2, 12), generator=gen)
    peft.eval()
    with torch.no_grad():
        ours = peft(input_ids=x).logits
        loaded = PeftModel.from_pretrained(tiny_moe(kind), str(tmp_path / "adapter")).eval()
        theirs = loaded(input_ids=x).logits
        base = tiny_moe(kind).eval()(input_ids=x).logits
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert (ours - base).abs().max() > 1e-3  # the experts' adapters changed the model
    saved = (tmp_path / "adapter" / "adapter_config.json").read_text()
    assert "experts.gate_up_proj" in saved


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_plan_lists_what_the_adapter_trains_per_kind_as_the_run_counts_it(kind, tmp_path):
    from trainer.planner import plan, report
    from trainer.planner.shape import ModelShape

    model = tiny_moe(kind)
    ran = adapters.trainable_by_kind(adapters.apply(model, lora_cfg(), grew_vocab=False))
    shape = ModelShape.from_hf_config(model.config.to_dict())
    planned = shape.lora_by_kind(4, ["auto"])
    assert {k: n for k, (n, _) in planned.items()} == ran  # exactly, every kind
    assert planned["experts"][1] == ("experts.gate_up_proj", "experts.down_proj")
    explicit = shape.lora_by_kind(4, ["q_proj", "v_proj"])
    assert list(explicit) == ["attention"]  # a plan without an experts row
    model.config.save_pretrained(str(tmp_path))
    cfg = lora_cfg().model_copy(deep=True)
    cfg.model.path = str(tmp_path)
    cfg.model.lora.r = 4
    line = report.format_plan(plan.plan_job(cfg)).splitlines()[1]
    assert line.startswith("adapters train: attention ") and "; experts " in line, line
    assert "(experts.gate_up_proj, experts.down_proj)" in line


def test_qlora_on_a_mixture_of_experts_is_refused_in_one_line_before_anything_loads(tmp_path):
    from trainer.errors import ConfigError
    from trainer.preflight import run_all

    model = tiny_moe("mixtral")
    model.config.save_pretrained(str(tmp_path))
    cfg = lora_cfg().model_copy(deep=True)
    cfg.model.path, cfg.model.adapter = str(tmp_path), "qlora"
    with pytest.raises(ConfigError) as err:
        run_all(cfg, strict=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.adapter qlora: model_type mixtral (")
    assert "config.json" in msg and "use model.adapter lora" in msg
    with pytest.raises(ConfigError, match="fused 3-D parameters"):  # the worker's guard too
        adapters.apply(model, cfg, grew_vocab=False)
    for mt in ("qwen3_moe", "qwen2_moe", "gpt_oss"):
        with pytest.raises(ConfigError):
            families.qlora_refusal("qlora", {"model_type": mt}, "config.json")
    families.qlora_refusal("lora", {"model_type": "mixtral"}, "config.json")
    families.qlora_refusal("qlora", {"model_type": "llama"}, "config.json")  # dense: fine
