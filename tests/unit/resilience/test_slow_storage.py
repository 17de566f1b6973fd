"""RAYLIFT_FAULT_SLOW_STORAGE=PATH:SECONDS (trainer.faults): a storage slowdown a
test switches on and off mid-run by making and removing PATH; every upload that starts
meanwhile pauses SECONDS more (on top of RAYLIFT_FAULT_UPLOAD_PAUSE_S)."""

from __future__ import annotations

from trainer import faults


def test_uploads_slow_down_while_the_file_exists(tmp_path, monkeypatch) -> None:
    switch = tmp_path / "slow"
    monkeypatch.delenv(faults.UPLOAD_PAUSE_ENV, raising=False)
    monkeypatch.setenv(faults.SLOW_STORAGE_ENV, f"{switch}:12.5")
    assert faults.upload_pause_s() == 0.0
    switch.touch()
    assert faults.upload_pause_s() == 12.5
    monkeypatch.setenv(faults.UPLOAD_PAUSE_ENV, "2")
    assert faults.upload_pause_s() == 14.5
    switch.unlink()
    assert faults.upload_pause_s() == 2.0
    assert faults.SLOW_STORAGE_ENV in faults.WORKER_ENV  # the driver passes it on


def test_a_pause_for_one_rank_leaves_the_others_alone(monkeypatch) -> None:
    """SECONDS@RANK: only that rank's uploads pause (the spot drill's slow second share)."""
    monkeypatch.delenv(faults.SLOW_STORAGE_ENV, raising=False)
    monkeypatch.setenv(faults.UPLOAD_PAUSE_ENV, "3@1")
    monkeypatch.setenv("RANK", "1")
    assert faults.upload_pause_s() == 3.0
    monkeypatch.setenv("RANK", "0")
    assert faults.upload_pause_s() == 0.0
