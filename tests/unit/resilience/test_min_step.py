"""RAYLIFT_FAULT_MIN_STEP_S=SECONDS:PATH (trainer.faults.min_step): until PATH
exists, each training step is padded to SECONDS, so a test's run outlasts what it waits
for on a fast machine; a slower step, or any step once PATH exists, is left alone."""

from __future__ import annotations

import pytest

from trainer import faults


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(faults, "_last_step_end", None)


def test_a_fast_step_is_padded_until_the_release_file_exists(tmp_path, monkeypatch):
    release = tmp_path / "floor-seen"
    monkeypatch.setenv(faults.MIN_STEP_ENV, f"0.05:{release}")
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731 - the step's end, as the loop would see it
    assert faults.min_step(clock) == 0.0  # the first step: nothing to count from
    now[0] += 0.01  # a 10 ms step
    assert faults.min_step(clock) == pytest.approx(0.04)
    now[0] += 0.2  # a step slower than the minimum
    assert faults.min_step(clock) == 0.0
    release.touch()
    now[0] += 0.001
    assert faults.min_step(clock) == 0.0
    assert faults.MIN_STEP_ENV in faults.WORKER_ENV  # the driver passes it on


def test_unset_it_never_sleeps(monkeypatch):
    monkeypatch.delenv(faults.MIN_STEP_ENV, raising=False)
    assert faults.min_step() == 0.0 and faults.min_step() == 0.0
