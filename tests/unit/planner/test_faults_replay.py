"""The simulator's replay of a fault schedule (trainer.planner.faults_replay): the run's own
cadence component on a clock of its own decides the saves; a fault resumes from the newest
save that had landed, by cause; a burst of faults shortens the next attempt's RAM tier;
goodput is the kept steps' time over the wall time."""

from __future__ import annotations

import pytest

from trainer.planner.cadence import Rates
from trainer.planner.faults_replay import Attempt, replay

# Young's intervals at a 1 s step: the RAM tier every 10 steps (9.5 s: C 0.025 s, M 1805 s),
# storage every 40 (39.5 s: M 31,205 s); 2.1 failures an hour, so two faults make a burst.
RATES = Rates(memory=3600 / 1805, storage=3600 / 31205)


def _attempt(**kw) -> Attempt:
    base = dict(
        step_s=1.0,
        memory_stall_s=0.025,
        memory_write_s=0.5,
        storage_stall_s=0.025,
        storage_write_s=2.0,
        restart_s=10.0,
    )
    return Attempt(**{**base, **kw})


def test_a_run_without_faults_measures_then_saves_at_the_rules_intervals() -> None:
    got = replay([_attempt()], steps=50, rates=RATES, max_interval_s=None, start_s=7.0, tail_s=3.0)
    assert got.lost_steps == 0 and got.resumed_from == []
    start, measured = got.decisions[:2]
    assert start["why"] == "start" and set(start["reasons"].values()) == {"measuring"}
    assert (measured["memory_every"], measured["storage_every"]) == (10, 40)
    # 50 steps, the stalls of 2 storage saves (5, 45) and 5 snapshots (5, 15, .., 45)
    assert got.wall_s == pytest.approx(7.0 + 50 + 7 * 0.025 + 3.0)
    assert got.goodput == pytest.approx(50 / got.wall_s)


@pytest.mark.parametrize(
    ("cause", "write_s", "back"),
    [
        ("worker_died", 0.5, 35),  # the snapshot of step 35 had landed
        ("node_lost", 3.0, 25),  # 35's was still on its way: the one before it
        ("preempted", 0.5, 37),  # drained: the emergency checkpoint of the step itself
        ("driver_lost", 0.5, 5),  # storage's own: the one at the attempt's start
    ],
)
def test_a_fault_resumes_from_the_newest_save_that_landed(cause: str, write_s: float, back: int):
    got = replay(
        [_attempt(end_step=37, cause=cause, memory_write_s=write_s), _attempt()],
        steps=60,
        rates=RATES,
        max_interval_s=None,
    )
    assert got.resumed_from == [back] and got.lost_steps == 37 - back
    assert got.kept_s == pytest.approx(60.0)
    lost_time = (37 - back) * 1.0
    assert got.wall_s > 60 + 10 + lost_time


def test_a_settled_fault_waits_for_the_save_in_flight_within_its_restart() -> None:
    """A drill's kill that waits for the saves in flight (N:settled): 35's snapshot, still on
    its way at step 37, has landed when the fault comes; the wait is inside restart_s."""
    kw = dict(end_step=37, cause="node_lost", memory_write_s=3.0)
    plain = replay([_attempt(**kw), _attempt()], steps=60, rates=RATES, max_interval_s=None)
    got = replay(
        [_attempt(**kw, settled=True), _attempt()], steps=60, rates=RATES, max_interval_s=None
    )
    assert plain.resumed_from == [25] and got.resumed_from == [35]
    assert got.lost_steps == 2
    # the next attempt starts restart_s after the last step, as without the wait (10 s >
    # the 1 s left of 35's trip): less the 10 steps it did not lose and 35's snapshot stall,
    # which the plain replay took again
    assert got.wall_s == pytest.approx(plain.wall_s - 10 * 1.0 - 0.025)


def test_two_faults_within_the_burst_window_shorten_the_ram_tier() -> None:
    got = replay(
        [_attempt(end_step=20), _attempt(end_step=30), _attempt()],
        steps=60,
        rates=RATES,
        max_interval_s=None,
    )
    # each from its newest snapshot that landed: 15; then 25, ten steps after the resume at
    # 15 (the second attempt starts from the costs journaled in the first: no measuring
    # snapshot at its start; 30's was on its way when the fault came)
    assert got.resumed_from == [15, 25] and got.lost_steps == (20 - 15) + (30 - 25)
    by = {n: [d for d in got.decisions if d["attempt"] == n] for n in (1, 2, 3)}
    assert by[2][-1]["memory_every"] == 10 and by[2][-1]["burst"] is False  # one fault
    third = by[3][-1]
    assert third["burst"] is True and third["why"] == "fault burst"
    assert third["memory_every"] == 5  # rates 4x higher: half the interval


def test_a_slow_storage_lengthens_the_storage_interval() -> None:
    """Writes longer than the storage interval: the write floor takes over once the first
    one lands."""
    got = replay([_attempt(storage_write_s=55.0)], steps=120, rates=RATES, max_interval_s=None)
    last = got.decisions[-1]
    assert last["reasons"]["storage"] == "write" and last["storage_every"] == 60
    assert got.decisions[1]["storage_every"] == 40  # before the first write had landed


def test_writes_measured_one_by_one_replace_the_attempts_single_figure() -> None:
    """A slowdown that came and went: the first storage write took 60 s, the rest 2 s. The
    write floor lengthens the storage interval once it lands; training never waits for an
    upload (the next one queues behind it)."""
    steady = replay([_attempt()], steps=100, rates=RATES, max_interval_s=None)
    slowed = replay([_attempt(storage_writes=[60.0])], steps=100, rates=RATES, max_interval_s=None)
    assert any(d["reasons"]["storage"] == "write" for d in slowed.decisions)
    assert not any(d["reasons"]["storage"] == "write" for d in steady.decisions)
    assert slowed.wall_s == pytest.approx(steady.wall_s, abs=0.2)
