"""The planner's (dp, pp, tp) figures: memory per rank and bytes sent per step, on the
published Llama-2 shapes (the g5 table in docs/strategies.md comes from these functions)."""

from __future__ import annotations

from trainer.config import JobConfig
from trainer.planner.memory import Setup, rank_memory
from trainer.planner.plan import plan
from trainer.planner.report import format_plan
from trainer.planner.shape import ModelShape
from trainer.planner.traffic import communication

L13 = ModelShape(5120, 40, 40, 40, 13824, 32000)
L70 = ModelShape(8192, 80, 64, 8, 28672, 32000)


def setup(world: int, tp: int = 1, pp: int = 1, **kw) -> Setup:
    base = dict(strategy="fsdp", world=world, micro_batch=8, block_size=1024, checkpointing=True)
    return Setup(**{**base, "tp": tp, "pp": pp, "microbatches": max(pp, 1) * 4, **kw})


def test_plain_fsdp_is_unchanged_by_the_new_fields():
    a, b = rank_memory(L13, setup(16)), rank_memory(L13, Setup(**{**setup(16).__dict__}))
    assert a.total == b.total
    assert communication(L13, setup(16))["tp"] == communication(L13, setup(16))["pp"] == 0


def test_tp_keeps_the_optimizer_share_and_moves_traffic_inside_the_node():
    fsdp, tp8 = setup(16), setup(16, tp=8)
    opt_fsdp, opt_tp = rank_memory(L13, fsdp).optimizer, rank_memory(L13, tp8).optimizer
    # Same 16 ranks share the state; only embeddings and lm_head are replicated over tp.
    assert 1.0 < opt_tp / opt_fsdp < 1.2
    c_fsdp, c_tp = communication(L13, fsdp), communication(L13, tp8)
    assert c_tp["dp"] < c_fsdp["dp"] / 10  # what crosses nodes: 2 replicas instead of 16
    assert c_tp["tp"] > 0
    # Local heads and MLP width shrink the per-layer activations.
    plain = rank_memory(L13, setup(16, checkpointing=False)).activations
    assert rank_memory(L13, setup(16, tp=8, checkpointing=False)).activations < plain


def test_pipeline_sends_activations_not_weights():
    c = communication(L70, setup(32, tp=8, pp=4, pp_schedule="1f1b"))
    assert c["dp"] == 0 and 0 < c["pp"] < 0.01 * communication(L70, setup(32))["dp"]
    hidden_tokens = 8 * 1024 * 8192 * 2  # bf16 hidden state of the micro batch
    assert c["pp"] == 2 * hidden_tokens


def test_gpipe_holds_every_microbatch_and_1f1b_only_pp():
    one = rank_memory(L13, setup(8, pp=2, pp_schedule="1f1b", microbatches=8))
    gpipe = rank_memory(L13, setup(8, pp=2, pp_schedule="gpipe", microbatches=8))
    inter = rank_memory(L13, setup(8, pp=2, pp_schedule="interleaved_1f1b", microbatches=8))
    assert gpipe.activations > 3 * one.activations
    assert one.activations < inter.activations < gpipe.activations


def test_setup_reads_the_layout_and_the_plan_prints_traffic():
    cfg = JobConfig.model_validate(
        {
            "model": {"path": "/m"},
            "data": {"train_file": "/d.jsonl", "block_size": 1024},
            "strategy": {"name": "fsdp", "tp": 4, "pp": 2, "microbatches": 4},
            "train": {"micro_batch_size": 4, "max_steps": 5, "grad_accum": 2},
            "scaling": {"num_workers": 16, "use_gpu": True},
            "run": {"name": "p"},
        }
    )
    s = Setup.from_config(cfg)
    assert (s.tp, s.pp, s.microbatches, s.grad_accum) == (4, 2, 4, 2)
    text = format_plan(plan(L13, s, search=False))
    assert "sent per rank per step: dp" in text and " tp " in text and " pp " in text
    assert any("(dp 2, pp 2, tp 4)" in n for n in rank_memory(L13, s).notes)
