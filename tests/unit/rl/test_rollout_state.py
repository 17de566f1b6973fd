"""The rollout a checkpoint keeps inside a num_iterations group (trainer.rollouts.state):
written only when the next step reuses the rollout, read back bit for bit (every array's
dtype, shape and bytes, the empty log-prob arrays included) through the checkpoint
manager's save, manifest and restore, for each rank its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from trainer.checkpoint.manager import CheckpointManager, Identity, TrainState, completeness
from trainer.config import load_config
from trainer.rollouts.feed import RolloutFeed
from trainer.rollouts.rows import PromptRow
from trainer.rollouts.state import RolloutPart, rollout_file
from trainer.storage.location import resolve


def _feed(tmp_path: Path, rank: int) -> RolloutFeed:
    """A rank's feed, unbound: keeping and restoring a rollout needs no model."""
    cfg = load_config(
        {
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_file": str(tmp_path / "prompts.jsonl")},
            "train": {
                "objective": "grpo",
                "micro_batch_size": 4,
                "grad_accum": 2,
                "rl": {
                    "num_generations": 4,
                    "num_iterations": 2,
                    "rewards": [{"function": "length_target", "options": {"target": 4}}],
                },
            },
            "scaling": {"num_workers": 2},
            "storage": {"path": str(tmp_path / "runs")},
            "run": {"name": "rl"},
        }
    )
    rows = [PromptRow(f"question {i}", {}) for i in range(8)]
    return RolloutFeed(cfg, rows, rank, 2)


def _rollout(seed: int) -> list[tuple[np.ndarray, ...]]:
    """Two micro batches as the feed lays them out: ids, attention, mask, advantages, the
    sampling-time log-probs (float32, not representable in fewer bits) and an empty ref."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        ids = rng.integers(0, 1000, (4, 11), dtype=np.int64)
        attention = (rng.random((4, 11)) > 0.2).astype(np.int64)
        mask = attention[:, 5:].copy()
        adv = rng.standard_normal(4).astype(np.float32)
        old = (rng.standard_normal((4, 6)) * 1e-3).astype(np.float32)
        ref = np.zeros((4, 0), dtype=np.float32)
        out.append((ids, attention, mask, adv, old, ref))
    return out


def _manager(part: RolloutPart, ts: TrainState, rank: int) -> CheckpointManager:
    identity = Identity("ddp", "whole", "none", 16, 512, "rl")
    return CheckpointManager(identity, {"rollout": part}, ts, rank, 2, 3, None)


def test_a_checkpoint_inside_a_group_keeps_each_ranks_rollout(tmp_path) -> None:
    ckpt = tmp_path / "step_00000003"
    held = {}
    for rank in range(2):  # each rank writes its own folder; storage holds them together
        feed = _feed(tmp_path, rank)
        held[rank] = _rollout(rank)
        feed.hold(1, held[rank])  # rollout 1 serves steps 3 and 4 (1-based)
        feed.step = 2  # step 3 trained: step 4 reuses rollout 1
        assert feed.held() is not None
        (out := tmp_path / f"rank{rank}").mkdir()
        _manager(RolloutPart(feed), TrainState(step=3), rank).save({}, out=out)
        shutil.copytree(out, ckpt, dirs_exist_ok=True)
    assert completeness(resolve(str(ckpt)))[0] is not None  # the manifests list the files
    manifest = json.loads((ckpt / "done" / "rank_1.json").read_text())
    assert manifest == {"rollout/rank_1.npz": rollout_file(ckpt, 1).stat().st_size}

    for rank in range(2):
        fresh = _feed(tmp_path, rank)
        ts = TrainState()
        _manager(RolloutPart(fresh), ts, rank).restore(ckpt)
        assert ts.step == 3
        micro = fresh.micro_batches(3)  # step 4: the kept rollout, nothing sampled
        assert fresh.micro_count == 2 and not fresh.stats
        for kept, back in zip(held[rank], micro, strict=True):
            for a, b in zip(kept, back, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes()


def test_a_checkpoint_at_a_groups_boundary_keeps_none(tmp_path) -> None:
    feed = _feed(tmp_path, 0)
    feed.hold(1, _rollout(0))
    feed.step = 3  # step 4 trained: step 5 samples rollout 2
    assert feed.held() is None
    out = tmp_path / "step_00000004"
    out.mkdir()
    RolloutPart(feed).save(out, 0)
    assert not (out / "rollout").exists()
    fresh = _feed(tmp_path, 0)
    RolloutPart(fresh).load(out, 0)  # nothing to load: the next step samples
    assert fresh.held() is None and fresh.micro_count == 0


def test_a_resumed_attempt_keeps_the_earlier_completions_log(tmp_path) -> None:
    """completions.jsonl is rewritten whole: an attempt resumed from step 10 (its first
    sample at step 14) keeps the step-7 rows an earlier attempt wrote, and replaces what
    that attempt logged of the steps it trains again."""
    from types import SimpleNamespace

    from trainer.objectives.grpo import GRPO

    run = resolve(str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    earlier = [{"step": 7, "completion": "old 7"}, {"step": 14, "completion": "lost 14"}]
    (tmp_path / "run" / "completions.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in earlier)
    )
    objective = GRPO(_feed(tmp_path, 0).cfg)
    objective.rt = SimpleNamespace(rank=0, run=run)
    objective._log_completions([{"step": 14, "completion": "new 14"}])
    objective._log_completions([{"step": 21, "completion": "new 21"}])
    rows = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert [json.loads(r)["completion"] for r in rows] == ["old 7", "new 14", "new 21"]
