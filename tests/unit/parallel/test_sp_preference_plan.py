"""The planner under sequence parallelism for a preference job: a pair is two sequences,
so at one sp a DPO rank holds the activations of an SFT rank with twice the micro batch,
and `raylift plan` names the smallest sp that fits for DPO as it does for SFT, and for
ZeRO-3 as for FSDP2; the objectives it plans sp for are the ones the config accepts. Pure
Python: no torch."""

from __future__ import annotations

import json

import pytest

from tests.support.model_configs import LLAMA3_8B
from trainer.config import load_config
from trainer.planner.plan import plan_job
from trainer.planner.sequence import OBJECTIVES


def _job(tmp_path, objective: str, micro: int = 1, deepspeed: bool = False, **strategy):
    d = tmp_path / "llama3-8b"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    if deepspeed:  # ZeRO-3 (its shipped config); checkpointing is the model's switch
        strategy, model = {"name": "deepspeed", **strategy}, {"gradient_checkpointing": True}
    else:
        strategy, model = {"name": "fsdp", "activation_checkpointing": True, **strategy}, {}
    return load_config(
        {
            "model": {"path": str(d), **model},
            "data": {"train_file": "unused.jsonl", "block_size": 16384},
            "train": {
                "micro_batch_size": micro,
                "max_steps": 2,
                "precision": "bf16",
                "objective": objective,
            },
            "strategy": strategy,
            "scaling": {"num_workers": 8, "use_gpu": True},
            "run": {"name": "long"},
        }
    )


def test_a_pair_is_two_sequences_of_activations_under_sp(tmp_path):
    dpo = plan_job(_job(tmp_path, "dpo", sp=4), "g5.48xlarge")
    sft2 = plan_job(_job(tmp_path, "sft", micro=2, sp=4), "g5.48xlarge")
    sft1 = plan_job(_job(tmp_path, "sft", sp=4), "g5.48xlarge")
    assert dpo.setup.micro_batch == 2 and dpo.setup.sp == 4
    assert dpo.rank.activations == pytest.approx(sft2.rank.activations, rel=1e-9)
    assert dpo.rank.activations > sft1.rank.activations


def test_plan_names_the_smallest_sp_for_a_dpo_job_that_leaves_it_unset(tmp_path):
    p = plan_job(_job(tmp_path, "dpo"), "g5.48xlarge")
    assert p.refused  # both sequences of a 16k pair on one rank do not fit
    (note,) = [n for n in p.notes if n.startswith("strategy.sp")]
    picked = int(note.removeprefix("strategy.sp: ").split()[0])
    assert note.endswith(f"set strategy.sp: {picked}") and picked > 1
    pinned = plan_job(_job(tmp_path, "dpo", sp=picked), "g5.48xlarge")
    assert not pinned.refused
    smaller = plan_job(_job(tmp_path, "dpo", sp=picked // 2), "g5.48xlarge")
    assert smaller.refused  # the smallest: half of it does not fit


def test_plan_names_the_smallest_sp_for_a_zero3_job_too(tmp_path):
    p = plan_job(_job(tmp_path, "sft", deepspeed=True), "g5.48xlarge")
    assert p.refused
    (note,) = [n for n in p.notes if n.startswith("strategy.sp")]
    assert note.endswith("set strategy.sp: 8"), note
    pinned = plan_job(_job(tmp_path, "sft", deepspeed=True, sp=8), "g5.48xlarge")
    assert not pinned.refused and pinned.setup.sp == 8


def test_the_planner_plans_sp_for_what_the_config_accepts(tmp_path):
    for objective in ("sft", "dpo", "ipo", "hinge", "simpo", "orpo", "kto", "grpo", "rloo"):
        try:
            load_config(
                {
                    "model": {"path": "m"},
                    "data": {"train_file": "x.jsonl", "block_size": 16},
                    "train": {"micro_batch_size": 1, "max_steps": 2, "objective": objective},
                    "strategy": {"name": "fsdp", "sp": 2},
                    "scaling": {"num_workers": 4},
                    "run": {"name": "sp"},
                }
            )
            accepted = True
        except Exception as e:
            assert "with strategy.sp > 1 is not in this build" in str(e), (objective, str(e))
            accepted = False
        assert accepted == (objective in OBJECTIVES), objective
