"""FSDP2 loads mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, Qwen2-MoE): their
per-expert Linears are converted to transformers 5's fused experts with transformers' own
conversion mapping (as from_pretrained does), and dense checkpoints pass through. That
FSDP2 then matches one process on 2 gloo ranks (loss, aux loss, every gradient, full and
LoRA) is tests/unit/strategies/test_moe_parity.py's, which replaced this file's own run."""

from __future__ import annotations

import torch

VOCAB = 64


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
