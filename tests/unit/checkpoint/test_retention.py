"""Retention when a spot notice's emergency checkpoint is torn (issue 56): a torn folder
never counts toward checkpoint.keep_last, so it never pushes out the newest complete
checkpoint, and a restart resumes from that one and clears the torn leftovers after it."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint import manager as ck
from trainer.storage.location import resolve


def _ckpt(run: Path, step: int, ranks_done: int = 2) -> None:
    """A two-rank checkpoint of `step` whose first `ranks_done` manifests landed."""
    d = run / ck.dir_name(step)
    for r in range(ranks_done):
        before = ck.local_files(d) if d.exists() else set()
        (d / "rng").mkdir(parents=True, exist_ok=True)
        (d / "rng" / f"rank_{r}.pt").write_bytes(b"r" * (8 + r))
        if r == 0:
            (d / ck.STATE_FILE).write_text(json.dumps({"step": step, "world_size": 2}))
        ck.write_manifest(d, r, before)


def _left(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run.glob("step_*"))


def test_torn_newer_checkpoints_never_push_out_the_newest_complete_one(tmp_path):
    _ckpt(tmp_path, 20)
    _ckpt(tmp_path, 25, ranks_done=1)  # the periodic upload rank 1 had in flight
    _ckpt(tmp_path, 26, ranks_done=1)  # the emergency checkpoint, rank 1's node gone
    run = resolve(str(tmp_path))
    ck.prune(run, keep_last=1)
    assert _left(tmp_path) == [20, 25, 26]
    latest = ck.find_latest(run)
    assert latest is not None and ck.step_of(latest) == 20
    # The restart clears what it will write again; the complete one stays.
    gone = ck.discard_torn_after(run, 20)
    assert len(gone) == 2 and _left(tmp_path) == [20]


def test_a_complete_emergency_checkpoint_prunes_by_keep_last_and_torn_older_ones(tmp_path):
    for step in (25, 50):
        _ckpt(tmp_path, step)
    _ckpt(tmp_path, 60, ranks_done=1)  # an attempt that died mid-upload
    _ckpt(tmp_path, 63)  # the emergency checkpoint, whole
    ck.prune(resolve(str(tmp_path)), keep_last=2)
    assert _left(tmp_path) == [50, 63]
