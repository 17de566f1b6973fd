"""Checkpoint completeness, torn-checkpoint handling and pruning, on a real filesystem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainer.checkpoint import manager as ck
from trainer.errors import CheckpointError
from trainer.storage.location import resolve


def make_ckpt(run: Path, step: int, world: int = 2, torn: str | None = None) -> Path:
    d = run / ck.dir_name(step)
    for r in range(world):
        before = ck.local_files(d) if d.exists() else set()
        d.mkdir(parents=True, exist_ok=True)
        (d / "rng").mkdir(exist_ok=True)
        (d / "rng" / f"rank_{r}.pt").write_bytes(b"x" * (10 + r))
        if r == 0:
            (d / "model").mkdir(exist_ok=True)
            (d / "model" / "model.safetensors").write_bytes(b"w" * 100)
            (d / ck.STATE_FILE).write_text(json.dumps({"step": step, "world_size": world}))
        ck.write_manifest(d, r, before)
    if torn == "truncated":
        (d / "model" / "model.safetensors").write_bytes(b"w" * 40)
    elif torn == "missing-rank":
        (d / "done" / f"rank_{world - 1}.json").unlink()
    elif torn == "no-state":
        (d / ck.STATE_FILE).unlink()
    return d


def test_complete_checkpoint(tmp_path):
    make_ckpt(tmp_path, 4)
    state, why = ck.completeness(resolve(str(tmp_path)).join(ck.dir_name(4)))
    assert why == "" and state["step"] == 4


def test_each_kind_of_torn_checkpoint_is_rejected(tmp_path):
    for step, kind, reason in (
        (1, "truncated", "expected 100 bytes, found 40"),
        (2, "missing-rank", "rank 1 manifest missing"),
        (3, "no-state", "trainer_state.json missing"),
    ):
        make_ckpt(tmp_path, step, torn=kind)
        state, why = ck.completeness(resolve(str(tmp_path)).join(ck.dir_name(step)))
        assert state is None and reason in why


def test_latest_skips_a_torn_newer_checkpoint(tmp_path):
    make_ckpt(tmp_path, 4)
    make_ckpt(tmp_path, 8, torn="truncated")
    latest = ck.find_latest(resolve(str(tmp_path)))
    assert latest is not None and latest.path.endswith("step_00000004")


def test_only_torn_checkpoints_is_an_error_naming_them(tmp_path):
    """Never silently train from scratch over a run's checkpoints."""
    make_ckpt(tmp_path, 4, torn="missing-rank")
    make_ckpt(tmp_path, 8, torn="truncated")
    run = resolve(str(tmp_path))
    with pytest.raises(CheckpointError) as err:
        ck.find_latest(run)
    msg = str(err.value)
    assert "step_00000004 (rank 1 manifest missing)" in msg
    assert "step_00000008 (model/model.safetensors: expected 100 bytes, found 40)" in msg
    assert "allow_restart_from_scratch" in msg and "\n" not in msg
    # Allowed explicitly: start over, and the torn folders are left for the user to see.
    assert ck.find_latest(run, allow_scratch=True) is None
    assert len(list(tmp_path.glob("step_*"))) == 2


def test_empty_run_folder_starts_fresh(tmp_path):
    assert ck.find_latest(resolve(str(tmp_path / "new-run"))) is None


def test_prune_keeps_last_k_and_never_the_newest(tmp_path):
    for s in (2, 4, 6, 8):
        make_ckpt(tmp_path, s)
    make_ckpt(tmp_path, 5, torn="missing-rank")
    make_ckpt(tmp_path, 10, torn="truncated")  # newer than the newest complete: kept
    ck.prune(resolve(str(tmp_path)), keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step_00000006", "step_00000008", "step_00000010"]


def test_rng_round_trip(tmp_path):
    import torch

    torch.manual_seed(3)
    state = ck.rng_state()
    a = torch.rand(3)
    d = tmp_path / "c"
    (d / "rng").mkdir(parents=True)
    torch.save(state, d / "rng" / "rank_0.pt")
    assert ck.load_rng(d, 0)
    assert torch.equal(torch.rand(3), a)
    assert not ck.load_rng(d, 1)


class _Counter:
    """A stateful part: rank 0 writes its value, every rank reads it back."""

    def __init__(self, value: int):
        self.value = value

    def save(self, out: Path, rank: int) -> None:
        if rank == 0:
            (out / "counter.json").write_text(json.dumps(self.value))

    def load(self, ckpt: Path, rank: int) -> None:
        self.value = json.loads((ckpt / "counter.json").read_text())


def _identity(**kw):
    base = dict(
        strategy="ddp", layout="ddp/1", adapter="none", global_batch=8, block_size=32, run_name="r"
    )
    return ck.Identity(**{**base, **kw})


def _manager(identity, counter, ts, rank=0, world=2):
    return ck.CheckpointManager(
        identity, {"counter": counter}, ts, rank, world, every=4, export_every=None
    )


def _save_world(tmp_path, identity, world=2, value=5, step=8):
    """Every rank saves its share; merge them into one folder as the runtime's upload does."""
    import shutil

    dest = tmp_path / ck.dir_name(step)
    for r in range(world):
        ts = ck.TrainState(step=step, tokens_seen=step * 256)
        out = _manager(identity, _Counter(value), ts, rank=r, world=world).save({"epoch": 0})
        shutil.copytree(out, dest, dirs_exist_ok=True)
        shutil.rmtree(out)
    return dest


def test_manager_round_trip_and_completeness(tmp_path):
    dest = _save_world(tmp_path, _identity())
    state, why = ck.completeness(resolve(str(tmp_path)).join(dest.name))
    assert why == "" and state["format"] == ck.FORMAT and state["layout"] == "ddp/1"
    counter, ts = _Counter(0), ck.TrainState()
    _manager(_identity(), counter, ts).restore(dest)
    assert counter.value == 5 and ts.step == 8 and ts.tokens_seen == 8 * 256


def test_manager_cadence():
    m = _manager(_identity(), _Counter(0), ck.TrainState())
    assert [s for s in range(1, 11) if m.due(s, end=10)] == [4, 8, 10]
    m.export_every = 3
    assert [s for s in range(1, 11) if m.export_due(s, 10, final=True)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if m.export_due(s, 10, final=False)] == [3, 6, 9]


def test_manager_refuses_another_strategy_layout_or_format(tmp_path):
    import pytest

    from trainer.errors import CheckpointError

    dest = _save_world(tmp_path, _identity())
    for other, needle in (
        (_identity(strategy="fsdp", layout="dcp/1"), "written by strategy ddp (layout ddp/1)"),
        (_identity(adapter="lora"), "model.adapter none"),
        (_identity(global_batch=16), "global batch 8"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            _manager(other, _Counter(0), ck.TrainState()).restore(dest)
    state = json.loads((dest / ck.STATE_FILE).read_text())
    del state["format"]  # what a checkpoint of the first layout looks like
    (dest / ck.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="checkpoint format 1 is not"):
        _manager(_identity(), _Counter(0), ck.TrainState()).restore(dest)


def test_identity_reads_an_older_layout_it_declares(tmp_path):
    """FSDP writes dcp/2 and still reads dcp/1 when tp = pp = 1; the declared list is not
    written into the checkpoint."""
    import pytest

    from trainer.errors import CheckpointError

    dest = _save_world(tmp_path, _identity(strategy="fsdp", layout="dcp/1"))
    reader = _identity(strategy="fsdp", layout="dcp/2", reads=("dcp/1",))
    _manager(reader, _Counter(0), ck.TrainState()).restore(dest)
    with pytest.raises(CheckpointError, match=re.escape("(layout dcp/1), this job uses fsdp")):
        _manager(_identity(strategy="fsdp", layout="dcp/2"), _Counter(0), ck.TrainState()).restore(
            dest
        )
    new = _save_world(tmp_path / "b", reader)
    assert "reads" not in json.loads((new / ck.STATE_FILE).read_text())
