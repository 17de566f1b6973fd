"""The planner counts online RL's rollouts: the KV cache of a rank's completions, a full
fine-tuning reference's frozen copy, and the rollout's share of the compute (Llama-2-7B,
16 ranks, 1 prompt × 8 generations a rank)."""

from __future__ import annotations

import pytest

from tests.support.jobs import llama7b_job
from trainer.config import load_config
from trainer.planner import plan as P
from trainer.planner.preference import GIB
from trainer.planner.rollouts import cost, kv_cache_bytes, notes
from trainer.planner.setup import Setup
from trainer.planner.shape import shape_for_job

M = 6_738_415_616  # Llama-2-7B's parameters


def _cfg(tmp_path, adapter: str = "none", **rl):
    return load_config(
        llama7b_job(
            tmp_path,
            model={"path": str(tmp_path / "model"), "adapter": adapter},
            strategy={"name": "fsdp"},
            train={
                "precision": "bf16",
                "objective": "grpo",
                "micro_batch_size": 8,
                "rl": {
                    "rewards": [{"function": "math_answer"}],
                    "max_completion_length": 256,
                    **rl,
                },
            },
            scaling={"num_workers": 16, "use_gpu": True},
        )
    )


def test_kv_cache_reference_and_compute_share(tmp_path):
    cfg = _cfg(tmp_path, beta=0.04, num_iterations=2)
    shape = shape_for_job(cfg)
    assert shape.params == M
    # K and V of 32 layers × 32 heads × 128 dims in bf16: 0.5 MiB a token.
    assert kv_cache_bytes(shape, 1, 2) == 2 * 32 * 32 * 128 * 2
    c = cost(cfg, shape, Setup.from_config(cfg), tokens_per_s=50_000.0)
    assert (c.prompts_per_rank, c.completions_per_rank) == (1, 8)
    assert c.tokens_per_completion == 512 + 256
    assert c.kv_cache_gib_per_rank == pytest.approx(8 * 768 * 0.5 / 1024)
    assert c.reference_gib_per_rank == pytest.approx(M * 2 / 16 / GIB)  # bf16, 16 shards
    # Sampling, the old log-probs and the reference: 3 forwards (2·M) against 2 updates (6·M).
    assert c.rollout_share == pytest.approx(6 / (6 + 12))
    # 128 completions × 768 tokens, 6·M of FLOPs per token at 6·M training's rate, over 2 steps.
    assert c.rollout_s_per_step == pytest.approx(128 * 768 * 6 / 6 / 50_000 / 2)
    text = notes(c)
    assert "1 prompts × 8 generations a rank" in text[0] and "3.00 GiB per rank" in text[0]
    assert "at least 33% of the compute" in text[1]
    assert "0.78 GiB per rank" in text[2]


def test_defaults_under_lora_have_no_frozen_copy(tmp_path):
    cfg = _cfg(tmp_path, adapter="lora")
    c = cost(cfg, shape_for_job(cfg), Setup.from_config(cfg), tokens_per_s=None)
    assert c.reference_gib_per_rank == 0 and c.rollout_s_per_step is None
    assert c.rollout_share == pytest.approx(2 / (2 + 4))  # one sampling forward, a 4·M update
    assert len(notes(c)) == 2


def test_plan_job_prints_the_rollout_lines_for_rl_only(tmp_path):
    rl = P.plan_job(_cfg(tmp_path, beta=0.04)).notes
    assert any(n.startswith("rollouts: 1 prompts × 8") for n in rl)
    assert any(n.startswith("reference: a frozen copy") for n in rl)
    sft = load_config(llama7b_job(tmp_path, scaling={"num_workers": 16, "use_gpu": True}))
    assert not any(n.startswith("rollouts:") for n in P.plan_job(sft).notes)
