"""The planner under sequence parallelism (trainer.planner.sequence): each rank's
activations are its share of the tokens plus, with checkpointing, the all-to-all's
buffers (without it, those only where they exceed the loss's), `raylift plan`
names the smallest sp that fits when the job leaves it unset, and docs/planning.md's
long-context table is the planner's (tools/docgen/spfigures.py)."""

from __future__ import annotations

import json
from dataclasses import replace

from tests.support.model_configs import LLAMA3_8B
from tools.docgen import spfigures
from trainer.config import load_config
from trainer.planner.memory import Setup, activation_bytes, logits_bytes
from trainer.planner.plan import plan_job
from trainer.planner.sequence import candidates, exchange_bytes

L8 = spfigures.MODELS["Llama-3-8B"]


def test_a_rank_holds_its_share_of_the_tokens_plus_the_exchange():
    one = spfigures.long_context_job(32768, 1)
    whole = activation_bytes(L8, one, True) - logits_bytes(L8, one, 32768)
    for sp in (2, 4, 8):
        s = replace(one, sp=sp)
        t = 32768 // sp
        share = activation_bytes(L8, s, True) - logits_bytes(L8, s, t) - exchange_bytes(L8, s)
        assert abs(share - whole / sp) < 1e-6 * whole
        # send + receive of q, k, v and the output, 2 bytes each (bf16), one layer
        assert exchange_bytes(L8, s) == 2 * t * 2 * (2 * 4096 + 2 * 1024)
    assert exchange_bytes(L8, one) == 0.0


def test_sp_divides_the_workers_the_block_and_the_kv_heads():
    assert candidates(L8, Setup("fsdp", world=16, block_size=32768)) == [1, 2, 4, 8]
    assert candidates(L8, Setup("fsdp", world=16, block_size=32766)) == [1, 2]
    assert candidates(L8, Setup("fsdp", world=6, block_size=32768)) == [1, 2]


def _job(tmp_path, **strategy):
    d = tmp_path / "llama3-8b"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    return load_config(
        {
            "model": {"path": str(d)},
            "data": {"train_file": "unused.jsonl", "block_size": 32768},
            "train": {"micro_batch_size": 1, "max_steps": 2, "precision": "bf16"},
            "strategy": {"name": "fsdp", "activation_checkpointing": True, **strategy},
            "scaling": {"num_workers": 8, "use_gpu": True},
            "run": {"name": "long"},
        }
    )


def test_plan_names_the_smallest_sp_that_fits_when_the_job_leaves_it_unset(tmp_path):
    p = plan_job(_job(tmp_path), "g5.48xlarge")
    assert p.refused  # the job as written (sp 1) does not fit: the verdict stays its own
    (note,) = [n for n in p.notes if n.startswith("strategy.sp")]
    assert note.startswith("strategy.sp: 4 is the smallest sequence-parallel size that fits")
    assert note.endswith("set strategy.sp: 4")
    pinned = plan_job(_job(tmp_path, sp=4), "g5.48xlarge")
    assert not pinned.refused and pinned.setup.sp == 4
    assert not [n for n in pinned.notes if n.startswith("strategy.sp")]
    assert pinned.rank.activations < p.rank.activations / 2


def test_the_long_context_table_is_the_planners():
    text = spfigures.PAGE.read_text()
    assert text.count(spfigures.BEGIN) == 1 and text.count(spfigures.END) == 1
    assert text == spfigures.page(text), "run: python -m tools.docgen.spfigures --write"
