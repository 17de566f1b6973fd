"""FSDP2 loads mixture-of-experts checkpoints (Qwen3-MoE, Mixtral): their per-expert
Linears are converted to transformers 5's fused experts with transformers' own
conversion mapping (as from_pretrained does), and on 2 gloo ranks each rank's loss
(language model + router aux loss), full and under LoRA on the experts, matches one
process within 1e-5. The module stays light: spawn imports it in each rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB = 64
KINDS = ("qwen3_moe", "mixtral")


def _cfg(model_dir: str, adapter: str):
    from trainer.config import load_config

    return load_config(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": {"r": 4, "alpha": 8}},
            "data": {"train_file": "unused.jsonl", "block_size": 12},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "strategy": {"name": "fsdp"},
            "scaling": {"num_workers": 2},
            "run": {"name": "moe-fsdp"},
        }
    )


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(0, VOCAB, (2, 12), generator=gen)
    y = x.clone()
    y[:, :2] = -100
    return x, y


def _two_ranks(rank: int, store: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.strategies.base import ModelSource, build_strategy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    losses = {}
    for kind in KINDS:
        model_dir = f"{root}/{kind}"
        for adapter in ("none", "lora"):
            strategy = build_strategy(_cfg(model_dir, adapter), torch.device("cpu"), rank, 2)
            strategy.setup(ModelSource(Path(model_dir), VOCAB))
            strategy.model.train()
            x, y = _batch(rank)
            n = (y[:, 1:] != -100).sum()
            losses[f"{kind}/{adapter}"] = float(strategy.train_micro(x, y, n))
            grads = [p.grad for p in strategy.model.parameters() if p.requires_grad]
            losses[f"{kind}/{adapter}_grads"] = sum(1 for g in grads if g is not None)
    Path(f"{out}.{rank}").write_text(json.dumps(losses))
    dist.destroy_process_group()


def test_fsdp2_loads_per_expert_checkpoints_and_matches_one_process(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.unit.model.test_moe_lora import lora_cfg, tiny_moe
    from trainer.objectives.sft import SFT

    for kind in KINDS:
        tiny_moe(kind).save_pretrained(str(tmp_path / kind))
    (f,) = (tmp_path / "qwen3_moe").glob("*.safetensors")
    with safe_open(str(f), framework="pt") as st:  # transformers saves per-expert Linears
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in set(st.keys())
    out = tmp_path / "losses"
    mp.start_processes(
        _two_ranks,
        args=(str(tmp_path / "store"), str(tmp_path), str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    for kind in KINDS:
        one = AutoModelForCausalLM.from_pretrained(str(tmp_path / kind), dtype=torch.float32)
        sft = SFT(lora_cfg())
        for rank in range(2):
            got = json.loads(Path(f"{out}.{rank}").read_text())
            x, y = _batch(rank)
            want = float(sft.loss(one, x, y, None))
            assert abs(got[f"{kind}/none"] - want) < 1e-5, (kind, rank, got, want)
            # B = 0 at the start: the adapted model's loss is the base's.
            assert abs(got[f"{kind}/lora"] - want) < 1e-5, (kind, rank, got, want)
            assert got[f"{kind}/none_grads"] == len(list(one.parameters()))
            assert got[f"{kind}/lora_grads"] > 0


def test_the_layout_conversion_fuses_experts_and_leaves_dense_checkpoints_alone(tmp_path):
    from tests.support.small_model import tiny_llama
    from tests.unit.model.test_moe_lora import tiny_moe
    from trainer.model.loading import full_state_dict
    from trainer.strategies.fsdp_build import checkpoint_layout

    dense = tiny_llama(0)
    sd = dense.state_dict()
    same = checkpoint_layout(dense, sd)
    assert set(same) == set(sd) and all(same[k] is sd[k] for k in sd)
    for kind in ("qwen3_moe", "mixtral", "qwen2_moe"):
        moe = tiny_moe(kind)
        moe.save_pretrained(str(tmp_path / kind))
        saved = full_state_dict(tmp_path / kind, VOCAB, 0.02, 0)
        assert "model.layers.1.mlp.experts.down_proj" not in saved  # per-expert Linears
        fused = checkpoint_layout(moe, saved)
        assert set(fused) == set(moe.state_dict())
        assert all(torch.equal(fused[k], v) for k, v in moe.state_dict().items())
