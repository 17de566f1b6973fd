"""Adapters on the sharded strategies, without a process group: the config's limits, the
NF4 shape rules preflight enforces, the adapters' deterministic start, and the planner's
rows (a 70B QLoRA on 8 × A10G)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.model import nf4_layout as nf4


def _cfg(strategy: dict, adapter: str = "lora", workers: int = 2, **model) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"path": "m", "adapter": adapter, **model},
            "data": {"train_file": "t.jsonl"},
            "strategy": strategy,
            "scaling": {"num_workers": workers},
            "run": {"name": "a"},
        }
    )


@pytest.mark.parametrize(
    ("strategy", "adapter"),
    [
        ({"name": "fsdp"}, "lora"),
        ({"name": "fsdp"}, "qlora"),
        ({"name": "deepspeed", "config": "zero2"}, "lora"),
        ({"name": "deepspeed", "config": "zero3"}, "lora"),
    ],
)
def test_adapters_compose_with_the_sharded_strategies(strategy, adapter):
    assert _cfg(strategy, adapter).model.adapter == adapter


@pytest.mark.parametrize(
    ("strategy", "adapter", "workers", "says"),
    [
        ({"name": "fsdp", "tp": 2}, "lora", 2, "strategy.tp/pp > 1"),
        ({"name": "fsdp", "tp": 2}, "qlora", 4, "strategy.tp/pp > 1"),
        ({"name": "deepspeed", "config": "zero3"}, "qlora", 2, "use strategy fsdp"),
    ],
)
def test_what_adapters_do_not_do_is_refused_in_one_line(strategy, adapter, workers, says):
    with pytest.raises(ValidationError) as err:
        _cfg(strategy, adapter, workers)
    msg = str(err.value).splitlines()[1]
    assert says in msg and "model.adapter" in msg


def test_nf4_block_sizes_do_not_depend_on_the_world_size():
    # Llama-2-70B's k_proj (1024 × 8192) and a 7B's q_proj: 256-block scale groups.
    assert nf4.block_sizes(1024, 8192) == (64, 256)
    assert nf4.block_sizes(4096, 4096) == (64, 256)
    # The tiny test model's 64 × 64: groups of 8 blocks, 8 groups.
    assert nf4.block_sizes(64, 64) == (64, 8)
    for dp in (1, 2, 4, 8):
        assert nf4.shard_problem(1024, 8192, dp) is None
        assert nf4.shard_problem(64, 64, dp) is None
    assert "rows do not split" in nf4.shard_problem(64, 64, 3)
    assert "whole" in nf4.shard_problem(64, 64, 16)
    assert "64-value" in nf4.shard_problem(10, 10, 1)
    # The bytes: half a byte a value, a byte a block, 4 bytes a group.
    assert nf4.quantized_nbytes(4096, 4096) == 4096 * 4096 * (0.5 + 1 / 64 + 4 / (64 * 256))


def _model_dir(folder: Path, hidden: int, inter: int, layers: int, heads: int, kv: int) -> Path:
    """A Llama model folder with only what preflight and the planner read."""
    folder.mkdir(exist_ok=True)
    conf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": 512 if hidden < 1024 else 32000,
        "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(conf))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_preflight_refuses_a_world_size_the_nf4_base_cannot_shard_over(tmp_path):
    from trainer.preflight import Report, check_model

    d = str(_model_dir(tmp_path, 64, 128, 2, 4, 2))
    check_model(_cfg({"name": "fsdp"}, "qlora", 4, path=d), True, Report())
    check_model(_cfg({"name": "ddp"}, "qlora", 3, path=d), True, Report())  # bitsandbytes
    with pytest.raises(ConfigError) as err:
        check_model(_cfg({"name": "fsdp"}, "qlora", 3, path=d), True, Report())
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("model.adapter qlora with strategy fsdp: q_proj (64×64")
    assert "over 3 workers" in msg and "scaling.num_workers" in msg


def test_adapter_initial_values_are_the_same_everywhere_and_peft_shaped():
    import math

    import torch

    from trainer.model.adapters import base_name, initial_value

    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    first = initial_value(a, (8, 64), seed=7)
    assert torch.equal(first, initial_value(a, (8, 64), seed=7))
    assert not torch.equal(first, initial_value(a, (8, 64), seed=8))
    assert not torch.equal(first, initial_value(a.replace("q_proj", "v_proj"), (8, 64), seed=7))
    bound = 1 / math.sqrt(64)  # kaiming-uniform(a=√5) over fan_in 64, as nn.Linear and peft
    assert float(first.abs().max()) <= bound and float(first.abs().max()) > 0.9 * bound
    b = a.replace("lora_A", "lora_B")
    assert not initial_value(b, (64, 8), seed=7).any()
    assert base_name(a.replace("lora_A.default", "base_layer")) == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    emb = "base_model.model.model.embed_tokens.modules_to_save.default.weight"
    assert base_name(emb) == base_name(emb.replace("modules_to_save.default", "original_module"))
    assert base_name(emb) == "model.embed_tokens.weight"


def test_planner_fits_a_70b_qlora_on_eight_a10g_with_fsdp_only():
    from trainer.planner.memory import Setup, host_memory, rank_memory
    from trainer.planner.shape import _REFERENCE_SHAPES

    llama70 = _REFERENCE_SHAPES[3]
    a10g = 24 * 2**30 * 0.93  # what the catalog leaves usable of 24 GB

    def need(strategy: str, adapter: str, world: int = 8) -> float:
        s = Setup(
            strategy=strategy, adapter=adapter, world=world, micro_batch=1, checkpointing=True
        )
        return rank_memory(llama70, s).total

    assert need("fsdp", "qlora") < 0.5 * a10g  # NF4 base sharded 8 ways: ~10 GiB
    assert need("ddp", "qlora") > a10g  # the whole 4-bit base on every GPU: ~40 GiB
    assert need("fsdp", "lora") < need("ddp", "lora") / 4
    assert need("zero3", "lora") < need("zero2", "lora") / 4
    assert need("fsdp", "qlora", 16) < need("fsdp", "qlora", 8)
    s = Setup(strategy="fsdp", adapter="qlora", world=8)
    assert host_memory(llama70, s, rank_memory(llama70, s)).load == 0.0  # shard by shard


def test_plan_cli_says_a_70b_qlora_fits_one_g5_48xlarge_with_fsdp_not_ddp(tmp_path, capsys):
    from tools import plan

    model = _model_dir(tmp_path / "llama-70b", 8192, 28672, 80, 64, 8)
    verdicts = {}
    for strategy in ("fsdp", "ddp"):
        job = tmp_path / f"{strategy}.yaml"
        job.write_text(
            f"model: {{path: {model}, adapter: qlora, gradient_checkpointing: true}}\n"
            "data: {train_file: t.jsonl, block_size: 1024}\n"
            f"strategy: {{name: {strategy}}}\n"
            "train: {micro_batch_size: 1, precision: bf16}\n"
            "scaling: {num_workers: 8, use_gpu: true}\n"
            "run: {name: q70}\n"
        )
        plan.main([str(job), "--instance", "g5.48xlarge"])
        out = capsys.readouterr().out
        assert f"{strategy} + qlora r=8" in out
        verdicts[strategy] = out.split("layout: 8 workers on 1× g5.48xlarge (rank 0):")[1].split()[
            0
        ]
    assert verdicts == {"fsdp": "fits", "ddp": "does"}  # "does not fit"


def test_deepspeed_gets_one_trainable_dtype_over_a_bf16_base():
    """peft upcasts new adapters to fp32 over a bf16 base while its copy of the grown
    embeddings stays bf16; ZeRO-3 in bf16 then stopped in an assertion on an H200."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model import adapters
    from trainer.strategies.deepspeed import config as dsconfig

    conf = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    base = LlamaForCausalLM(conf).to(torch.bfloat16)
    cfg = _cfg({"name": "deepspeed", "config": "zero3"})
    model = adapters.apply(base, cfg, grew_vocab=True)
    mixed = {p.dtype for p in model.parameters() if p.requires_grad}
    assert mixed == {torch.float32, torch.bfloat16}  # what DeepSpeed refused
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    assert dsconfig.precision(ds) == "bf16" and dsconfig.precision({}) == "fp32"
    changed = adapters.one_trainable_dtype(model, torch.bfloat16)
    assert changed > 0
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora" not in n
               and "modules_to_save" not in n)  # fmt: skip
