"""Checkpoint staging (trainer.staging): a checkpoint holds the state as it was when the
step saved it, however far training has moved on while the background thread writes it;
the manifest comes only after the files; a failed write fails the upload's wait. One
process, a real DDP strategy on a tiny Llama, no Ray."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.unit.test_state_nbytes import VOCAB, _strategy, model_dir  # noqa: F401 - fixture
from trainer import checkpoint as ck
from trainer import staging


def _train_step(s, seed: int) -> None:
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    s.backward(s.model(input_ids=x, labels=x).loss)
    s.step()


def _manager(s, ts: ck.TrainState) -> ck.CheckpointManager:
    identity = ck.Identity("ddp", "ddp/1", "none", 2, 16, "staging")
    parts = {"strategy": ck.StrategyPart(s), "rng": ck.RNGPart(0, ts)}
    return ck.CheckpointManager(identity, parts, ts, 0, 1, every=1, export_every=None)


def test_ddp_checkpoint_holds_the_state_of_its_step_while_training_goes_on(model_dir):  # noqa: F811
    """The background write is held until three more optimizer steps have changed every
    weight and moment in place; the files must still hold the saved step's values."""
    s = _strategy(model_dir)
    _train_step(s, 0)
    want_model = {k: v.clone() for k, v in s.hf.state_dict().items()}
    want_moment = {
        i: st["exp_avg"].clone() for i, st in enumerate(s.optimizer.state_dict()["state"].values())
    }
    gate = threading.Event()
    real = s.stage_state

    def gated(out: Path, rank: int):
        write = real(out, rank)

        def held() -> None:
            assert gate.wait(60)
            write()

        return held

    s.stage_state = gated
    ts = ck.TrainState(step=1, tokens_seen=32)
    out = _manager(s, ts).save({})
    assert not (out / "done" / "rank_0.json").exists()  # the manifest waits for the files
    for seed in (1, 2, 3):
        _train_step(s, seed)
    assert not torch.equal(s.hf.state_dict()["lm_head.weight"], want_model["lm_head.weight"])
    gate.set()
    staging.wait_written(out)
    assert (out / "done" / "rank_0.json").exists()
    got = torch.load(out / "strategy" / "model.pt", weights_only=True)
    assert set(got) == set(want_model)
    for k, v in want_model.items():
        assert torch.equal(got[k], v), k
    opt = torch.load(out / "strategy" / "optimizer.pt", weights_only=False)
    for i, st in enumerate(opt["state"].values()):
        assert torch.equal(st["exp_avg"], want_moment[i])
    state, why = ck.completeness(_local(out))
    assert why == "" and state["step"] == 1


def test_a_failed_background_write_fails_the_wait_and_leaves_no_manifest(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()

    def broken() -> None:
        raise OSError("No space left on device")

    staging.submit(folder, broken)
    with pytest.raises(OSError, match="No space left"):
        staging.wait_written(folder)
    staging.wait_written(folder)  # nothing pending any more: returns at once


def test_snapshot_copies_tensors_and_keeps_structure():
    t = torch.arange(4.0)
    state = {"a": t, "b": [t, (t, 3)], "c": "x"}
    copy = staging.snapshot(state)
    t.add_(1)
    assert torch.equal(copy["a"], torch.arange(4.0))
    assert torch.equal(copy["b"][1][0], torch.arange(4.0)) and copy["b"][1][1] == 3
    assert copy["c"] == "x" and isinstance(copy["b"][1], tuple)


def _local(path: Path):
    from trainer.storage import resolve

    return resolve(str(path))
