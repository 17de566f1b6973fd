"""The spot notice's emergency checkpoint (trainer.resilience.preemption.ride_out): the
`preemption` record, which tells the world the node may go, is written only once every
rank's share is in storage, and a checkpoint still torn then fails the attempt instead of
being journaled as saved. Run on a real filesystem with a runtime whose barrier is the
moment the slower rank's manifest lands."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from trainer.checkpoint import manager as ck
from trainer.errors import CheckpointError
from trainer.resilience import journal
from trainer.resilience.journal import Journal
from trainer.resilience.preemption import PreemptionWatch
from trainer.storage.location import resolve
from trainer.storage.retry import RetryingHandler

STEP = 26


def _share(ckpt: Path, rank: int) -> None:
    """One rank's files of the checkpoint, its manifest last (as the upload writes them)."""
    before = ck.local_files(ckpt) if ckpt.exists() else set()
    (ckpt / "rng").mkdir(parents=True, exist_ok=True)
    (ckpt / "rng" / f"rank_{rank}.pt").write_bytes(b"r" * (8 + rank))
    if rank == 0:
        (ckpt / ck.STATE_FILE).write_text(json.dumps({"step": STEP, "world_size": 2}))
    ck.write_manifest(ckpt, rank, before)


class _Rank0:
    """Rank 0 of two: its own share is uploaded; rank 1's manifest lands when the ranks
    meet (`barrier`), or never (`slow_rank_lands=False`: its node went first)."""

    rank, world_size = 0, 2

    def __init__(self, root: Path, slow_rank_lands: bool = True):
        self.run = resolve(str(root))
        self.journal = Journal(self.run, "attempt-1-rank0")
        self.ckpt = root / ck.dir_name(STEP)
        self.slow_rank_lands = slow_rank_lands
        self.waited: list[float | None] = []
        _share(self.ckpt, 0)

    def barrier(self) -> None:
        if self.slow_rank_lands:
            _share(self.ckpt, 1)

    def wait_out_preemption(self, deadline_s: float | None) -> None:
        self.waited.append(deadline_s)


def _noticed(rt: Any) -> PreemptionWatch:
    watch = PreemptionWatch(rt, enabled=True)
    watch.notice = {"deadline_s": 15.0, "ranks": [1]}
    return watch


def test_the_notice_is_journaled_only_when_every_ranks_share_is_in_storage(tmp_path):
    rt = _Rank0(tmp_path)
    _noticed(rt).ride_out(STEP, time.monotonic())
    records = [r for r in journal.read(rt.run) if r["event"] == "preemption"]
    assert len(records) == 1 and records[0]["step"] == STEP and records[0]["complete"]
    # What a reclaim at the moment of the record leaves: a checkpoint to resume from.
    latest = ck.find_latest(rt.run)
    assert latest is not None and ck.step_of(latest) == STEP
    assert len(rt.waited) == 1 and rt.waited[0] is not None and rt.waited[0] <= 15.0


def test_a_checkpoint_still_torn_fails_the_attempt_and_journals_no_notice(tmp_path):
    rt = _Rank0(tmp_path, slow_rank_lands=False)
    with pytest.raises(CheckpointError, match=r"step 26 is incomplete .*rank 1 manifest missing"):
        _noticed(rt).ride_out(STEP, time.monotonic())
    assert [r for r in journal.read(rt.run) if r["event"] == "preemption"] == []
    assert rt.waited == []


class _Blips(RetryingHandler):
    """Local storage whose first `blips` calls fail as an S3 endpoint briefly down does."""

    def __init__(self, blips: int):
        super().__init__(pafs.LocalFileSystem(), 0.0)
        self.blips = blips

    def _call(self, fn: Any, *args: Any) -> Any:
        if self.blips > 0:
            self.blips -= 1
            raise OSError("AWS Error NETWORK_CONNECTION: connection reset by peer")
        return fn(*args)


def test_a_storage_blip_during_the_check_is_retried_not_called_torn(tmp_path):
    """The completeness check reads storage with the uploads' retry policy: two failed
    listings (a blip), then the complete checkpoint is found and the notice journaled."""
    rt = _Rank0(tmp_path)
    rt.retry_s = 30.0
    blips = _Blips(2)
    rt.run = dataclasses.replace(rt.run, fs=pafs.PyFileSystem(blips))
    _noticed(rt).ride_out(STEP, time.monotonic())
    assert blips.blips == 0  # both blips were met, and retried past
    records = [r for r in journal.read(resolve(str(tmp_path))) if r["event"] == "preemption"]
    assert len(records) == 1 and records[0]["step"] == STEP and records[0]["complete"]
    assert len(rt.waited) == 1
