"""Corpora mixed by weight: the realised mix matches the weights, the blocks of a step do
not depend on the number of workers or on where a run resumed, and a mix job names its
sources in config, preflight and cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.data import write
from trainer.config import ConfigError, DataSection, load_config
from trainer.data.blocks import PackedBlocks
from trainer.data.mixing import MixedBatches, MixPlan
from trainer.data.tokenize import prepare
from trainer.model.loading import load_tokenizer

SIZES = [1000, 300, 100]
WEIGHTS = [6.0, 3.0, 1.0]


def plan(micro: int = 2, accum: int = 4, world: int = 2, seed: int = 3) -> MixPlan:
    return MixPlan(SIZES, WEIGHTS, micro, accum, world, seed)


def test_realised_mix_matches_weights_over_an_epoch():
    p = plan()
    steps = p.steps_per_epoch
    assert steps == sum(SIZES) // 16
    drawn = np.concatenate([p.global_blocks(s)[0] for s in range(steps)])
    share = np.bincount(drawn, minlength=3) / len(drawn)
    expect = p.probabilities
    sigma = np.sqrt(expect * (1 - expect) / len(drawn))
    assert (np.abs(share - expect) < 4 * sigma).all(), (share, expect)
    # The small, heavily drawn source went round more than once, each pass a permutation.
    src, blocks = zip(*(p.global_blocks(s) for s in range(steps)), strict=True)
    src, blocks = np.concatenate(src), np.concatenate(blocks)
    small = blocks[src == 2]
    first_pass = small[:100]
    assert sorted(first_pass.tolist()) == list(range(100))
    assert len(small) > 100 and (small[100:200] != first_pass[: len(small[100:200])]).any()
    assert (blocks[src == 0] < 1000).all() and len(set(blocks[src == 0].tolist())) == (
        src == 0
    ).sum()


def _global(p: MixPlan, step: int) -> list[tuple[int, int]]:
    """The step's (source, block) pairs in global-batch order, read rank by rank."""
    per_rank = [p.step_indices(step, r) for r in range(p.world_size)]
    out = []
    for m in range(p.grad_accum):
        for r in range(p.world_size):
            src, blocks = per_rank[r][m]
            out += list(zip(src.tolist(), blocks.tolist(), strict=True))
    return out


def test_blocks_do_not_depend_on_workers_or_resume():
    layouts = [plan(2, 4, 2), plan(2, 8, 1), plan(2, 2, 4), plan(2, 1, 8)]
    for step in (0, 1, 7, 40, 41):
        seqs = [_global(p, step) for p in layouts]
        assert all(s == seqs[0] for s in seqs), step
    # A plan created at step 41 (a resumed run) agrees with one that walked there.
    walked = plan()
    for s in range(42):
        walked.global_blocks(s)
    fresh = plan()
    assert _global(fresh, 41) == _global(walked, 41)
    assert (fresh.counts_before(41) == walked.counts_before(41)).all()
    assert _global(plan(seed=4), 5) != _global(plan(), 5)


def test_mixed_batches_read_each_source(tmp_path, tiny):
    tok = load_tokenizer(tiny["model"], str(tiny["tokens"]))
    a = prepare(
        write(tmp_path / "a.jsonl", [{"text": f"apples {i} " * 9} for i in range(80)]),
        tok,
        progress=False,
    )
    b = prepare(
        write(tmp_path / "b.jsonl", [{"text": f"books {i} " * 9} for i in range(80)]),
        tok,
        progress=False,
    )
    sources = [PackedBlocks(a, 16), PackedBlocks(b, 16)]
    p = MixPlan([len(s) for s in sources], [1.0, 1.0], 4, 1, 1, 0)
    ((ids, labels),) = MixedBatches(sources, p, 0).micro_batches(3)
    ((src, blocks),) = p.step_indices(3, 0)
    for row, (i, k) in enumerate(zip(src, blocks, strict=True)):
        want_ids, want_labels = sources[i].gather(np.array([k]))
        assert (ids[row] == want_ids[0]).all() and (labels[row] == want_labels[0]).all()


def test_source_lists_in_config(tmp_path):
    d = DataSection(
        train_file=[
            "data/code.jsonl",
            {"path": "s3://b/web/", "weight": 3},
            {"path": "x/*.jsonl.gz", "name": "books"},
        ],
        eval_file="e.jsonl",
    )
    assert [(s.name, s.weight) for s in d.sources()] == [
        ("code", 1.0),
        ("web", 3.0),
        ("books", 1.0),
    ]
    assert [s.name for s in d.sources("eval")] == ["e"]
    path = tmp_path / "job.yaml"
    job = {
        "model": {"path": str(tmp_path)},
        "data": {"train_file": [{"path": "a/x.jsonl"}, {"path": "b/x.jsonl", "weight": 2}]},
        "train": {"max_steps": 2},
        "storage": {"path": str(tmp_path / "runs")},
        "run": {"name": "mix"},
    }
    path.write_text(json.dumps(job))
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    assert "\n" not in str(err.value) and "x more than once" in str(err.value)
    job["data"]["train_file"][1]["weight"] = 0
    path.write_text(json.dumps(job))
    with pytest.raises(ConfigError, match="weight"):
        load_config(path, [])
