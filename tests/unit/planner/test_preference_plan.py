"""The planner's preference numbers: pairs are two sequences, the reference pass's time,
and what a live reference model would have cost."""

from __future__ import annotations

import pytest

from tests.support.jobs import llama7b_job
from trainer.config import load_config
from trainer.planner import plan as P
from trainer.planner.memory import Setup
from trainer.planner.preference import GIB, cost, notes

M = 6_738_415_616  # Llama-2-7B's parameters


def _cfg(tmp_path, objective: str, adapter: str = "none", strategy: str = "fsdp"):
    return load_config(
        llama7b_job(
            tmp_path,
            model={"path": str(tmp_path / "model"), "adapter": adapter},
            strategy={"name": strategy},
            train={"precision": "bf16", "objective": objective, "micro_batch_size": 2},
            scaling={"num_workers": 16, "use_gpu": True},
        )
    )


def test_pairs_are_two_sequences_in_memory_and_tokens(tmp_path):
    sft, dpo = _cfg(tmp_path, "sft"), _cfg(tmp_path, "dpo")
    assert Setup.from_config(sft).micro_batch == 2
    assert Setup.from_config(dpo).micro_batch == 4  # 2 pairs: 4 sequences of activations
    assert dpo.tokens_per_step == 2 * sft.tokens_per_step == 2 * 16 * 2 * 512
    assert P.plan_job(dpo).rank.total > P.plan_job(sft).rank.total


def test_precomputed_reference_costs_one_forward_pass_and_no_memory(tmp_path):
    cfg = _cfg(tmp_path, "dpo")
    s = Setup.from_config(cfg)
    tokens = 100_000_000  # both sequences of every pair
    c = cost(cfg, M, s, tokens_per_s=50_000.0, tokens_per_epoch=tokens)
    assert c.reference == "precomputed" and c.pairs_per_step == 32 and c.sequences_per_step == 64
    # A forward is 2·M of training's 6·M FLOPs per token: a third of an epoch's time.
    assert c.prepass_s == pytest.approx(tokens / 50_000 / 3)
    assert c.step_overhead == 0
    # A live reference: bf16 weights, sharded over 16 FSDP ranks, and the same forwards.
    assert c.live_reference_gib_per_rank == pytest.approx(M * 2 / 16 / GIB)
    assert c.live_reference_s == pytest.approx(tokens / 50_000 / 3)
    text = notes(c)
    assert "32 pairs per step = 64 sequences" in text[0]
    assert "precomputed before step 1 (~11 min" in text[1] and "0.78 GiB per rank" in text[1]


def test_adapter_off_reference_and_reference_free_objectives(tmp_path):
    cfg = _cfg(tmp_path, "dpo", adapter="lora", strategy="ddp")
    c = cost(cfg, M, Setup.from_config(cfg), None, None)
    # A frozen base: 4·M per token trained, a forward more is half a step; a live
    # reference on DDP would be a whole second bf16 copy per rank.
    assert c.reference == "adapter_off" and c.step_overhead == pytest.approx(0.5)
    assert c.prepass_s is None and c.live_reference_gib_per_rank == pytest.approx(M * 2 / GIB)
    assert "+50% compute, no memory" in notes(c)[1]
    q = _cfg(tmp_path, "dpo", adapter="qlora", strategy="ddp")
    assert cost(q, M, Setup.from_config(q), None, None).live_reference_gib_per_rank < 4.5
    for objective in ("simpo", "orpo"):
        cfg = _cfg(tmp_path, objective)
        c = cost(cfg, M, Setup.from_config(cfg), 50_000.0, 10**8)
        assert c.reference == "none" and c.prepass_s is None and c.step_overhead == 0
    assert cost(_cfg(tmp_path, "sft"), M, Setup.from_config(cfg), None, None) is None


def test_the_plan_prints_the_preference_lines(tmp_path):
    p = P.plan_job(_cfg(tmp_path, "dpo"), "g5.12xlarge", tokens_per_epoch=10**8)
    lines = [n for n in p.notes if "pairs per step" in n or n.startswith("reference:")]
    assert len(lines) == 2 and "live reference model would add" in lines[1]
    assert not [n for n in P.plan_job(_cfg(tmp_path, "sft")).notes if "pairs" in n]
