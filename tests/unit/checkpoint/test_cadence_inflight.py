"""What the cadence does with writes still in flight (trainer.planner.cadence): a save
due while its tier's write travels on any rank waits for it, training on, and the ranks
agree on that through the step's all-reduce; a step's time is measured without what held
the training thread outside the step (a synchronous upload is part of its save's stall, a
wait for an upload slot is not a cost at all)."""

from __future__ import annotations

import pytest

from trainer.planner import cadence as cad
from trainer.planner.cadence import Cadence, Rates
from trainer.planner.faults_replay import Attempt, replay


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _decided(log: list[dict]) -> Cadence:
    c = Cadence(
        Rates(memory=2.0, storage=0.05),
        memory_tier=True,
        max_overhead=0.05,
        max_interval_s=None,
        journal=lambda event, **f: log.append({"event": event, **f}),
        clock=Clock(),
    )
    for _ in range(3):
        c.step_time(1.0)
    c.saved(cad.RAM, 0.05)
    c.saved(cad.STORAGE, 2.0)
    c.decide_alone()
    return c


def _sum(*asks: list[float]) -> list[float]:
    return [sum(col) for col in zip(*asks, strict=True)]


def test_a_save_due_while_its_write_is_in_flight_on_any_rank_waits_for_it() -> None:
    log: list[dict] = []
    ranks = [_decided(log), _decided(log)]
    every = ranks[0].decision.storage_every
    assert every > 1 and ranks[1].decision.storage_every == every
    uploading = {0: False, 1: False}
    for r, c in enumerate(ranks):
        c.upload_in_flight = lambda r=r: uploading[r]
    # rank 1's upload is still on its way at the step's start: neither rank saves
    uploading[1] = True
    summed = _sum(*(c.ask() for c in ranks))
    assert summed[-1] == 1.0
    for c in ranks:
        c.agreed(summed)
    assert [c.storage_due(every) for c in ranks] == [False, False]
    assert [c.deferred[cad.STORAGE] for c in ranks] == [1, 1]
    # the snapshots are not held back by an upload
    assert [c.memory_due(ranks[0].decision.memory_every) for c in ranks] == [True, True]
    # it landed before the next step's start: both save now, and count from there
    uploading[1] = False
    summed = _sum(*(c.ask() for c in ranks))
    for c in ranks:
        c.agreed(summed)
    assert [c.storage_due(every + 1) for c in ranks] == [True, True]
    assert not ranks[0].storage_due(2 * every)  # every steps from every + 1
    assert ranks[0].storage_due(2 * every + 1)


def test_a_snapshot_due_while_one_travels_waits_and_the_decision_journals_it() -> None:
    log: list[dict] = []
    c = _decided(log)
    m = c.decision.memory_every
    travelling = [True]
    c.snapshot_in_flight = lambda: travelling[0]
    c.agreed(c.ask())
    assert not c.memory_due(m) and c.deferred == {cad.RAM: 1, cad.STORAGE: 0}
    travelling[0] = False
    c.agreed(c.ask())
    assert c.memory_due(m + 1)
    c.shorten("rebalance recommendation")  # a new decision: journaled with the count
    c.decide_alone()
    assert log[-1]["deferred"] == {cad.RAM: 1, cad.STORAGE: 0}


def test_a_steps_time_leaves_out_what_held_it_outside_the_step() -> None:
    clock = Clock()
    c = Cadence(Rates(2.0, 0.05), memory_tier=True, clock=clock)
    c.tick(1)
    clock.t += 1.0
    c.tick(2)
    assert c.costs.step_s == pytest.approx(1.0)
    # a step of 1 s, then 30 s waiting for an upload slot: not a cost of the intervals
    clock.t += 31.0
    c.blocked(30.0)
    c.tick(3)
    assert c.costs.step_s == pytest.approx(1.0)
    assert c.costs.storage_stall_s == 0.0
    # a synchronous upload (checkpoint.upload: sync) is part of its save's stall: one sample
    c.saved(cad.STORAGE, 0.5)
    c.blocked(9.5, cad.STORAGE)
    clock.t += 11.0
    c.tick(4)
    assert c.costs.step_s == pytest.approx(1.0)
    assert c.costs.storage_stall_s == pytest.approx(10.0)  # the first sample is the mean
    c.saved(cad.STORAGE, 0.5)
    c.blocked(19.5, cad.STORAGE)
    assert c.costs.storage_stall_s == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)


def test_the_replay_defers_a_storage_save_behind_a_slow_upload() -> None:
    """The first storage write takes 60 s: the saves that come due before it lands wait
    (journaled as deferred) instead of queueing uploads behind it; training never stops."""
    rates = Rates(memory=3600 / 1805, storage=3600 / 31205)
    base = dict(step_s=1.0, memory_stall_s=0.025, memory_write_s=0.5, storage_stall_s=0.025)
    steady = replay(
        [Attempt(**base, storage_write_s=2.0)], steps=100, rates=rates, max_interval_s=None
    )
    slowed = replay(
        [Attempt(**base, storage_write_s=2.0, storage_writes=[60.0])],
        steps=100,
        rates=rates,
        max_interval_s=None,
    )
    assert steady.decisions[-1]["deferred"][cad.STORAGE] == 0
    assert slowed.decisions[-1]["deferred"][cad.STORAGE] > 0
    assert slowed.wall_s == pytest.approx(steady.wall_s, abs=0.2)


def _snapshots_every_10(wall, phases=None) -> Cadence:
    """40 steps of a cadence on its own clock, a snapshot after every 10th (0.05 s on the
    training thread, then two steps' trip): `wall(done, first_trip, travelling)` is a
    step's wall time, `phases(...)` its own phases' (None: not timed)."""
    clock = Clock()
    c = Cadence(Rates(memory=2.0, storage=0.05), memory_tier=True, max_interval_s=None, clock=clock)
    travelling = [0]
    c.snapshot_in_flight = lambda: travelling[0] > 0
    c.tick(0)
    for done in range(1, 41):
        c.ask()  # the step's start: what is in flight
        first_trip = bool(travelling[0]) and done < 20
        args = (done, first_trip, bool(travelling[0]))
        clock.t += wall(*args)
        travelling[0] = max(0, travelling[0] - 1)
        c.tick(done, None if phases is None else phases(*args))
        if done % 10 == 0:
            clock.t += 0.05
            c.saved(cad.RAM, 0.05)
            travelling[0] = 2
    return c


def test_the_steps_a_travelling_snapshot_slows_count_as_its_cost() -> None:
    """Idle steps take 1 s; the two steps that begin while a snapshot travels take 1.5 s:
    each snapshot costs its 0.05 s stall and 1 s of inflation, and the rule spaces the
    snapshots for that cost (√21 times further apart than for the stall alone)."""
    c = _snapshots_every_10(lambda done, first, travelling: 1.5 if travelling else 1.0)
    assert c.costs.memory_inflation_s == pytest.approx(1.0)
    assert c.costs.cost(cad.RAM) == pytest.approx(1.05)
    with_inflation = cad.decide(c.costs, c.rates, memory_tier=True, max_overhead=1.0)
    stall_only = cad.Costs(step_s=c.costs.step_s, memory_stall_s=0.05, storage_stall_s=1.0)
    without = cad.decide(stall_only, c.rates, memory_tier=True, max_overhead=1.0)
    assert with_inflation.memory_every / without.memory_every == pytest.approx(21**0.5, rel=0.1)


def test_the_first_trip_and_time_outside_the_steps_phases_are_not_inflation() -> None:
    """The attempt's first snapshot sets its keeper up: the steps it travels take 3 s.
    The next one's steps take 1.5 s of wall time, but their own phases 1 s (the rest was
    outside the step: a report, a thread's start). Neither is charged as inflation."""
    c = _snapshots_every_10(
        lambda done, first, travelling: 3.0 if first else (1.5 if travelling else 1.0),
        lambda done, first, travelling: 3.0 if first else 1.0,
    )
    assert c.costs.memory_inflation_s == 0.0


def test_noisy_steps_do_not_move_the_intervals_every_few_steps() -> None:
    """Single steps on a shared host vary 10x (5-60 ms here, seeded): the intervals the
    rule gives in seconds stand still, so the run keeps its decision instead of journaling
    a new one every REDECIDE_STEPS: 4 decisions in 800 steps (0.3-weighted step times gave
    34, moving the intervals by more than MOVE at most checks)."""
    import random

    rng = random.Random(0)
    log: list[dict] = []
    clock = Clock()
    c = Cadence(
        Rates(memory=2.0, storage=0.05),
        memory_tier=True,
        max_interval_s=None,
        journal=lambda event, **f: log.append(f),
        clock=clock,
    )
    c.tick(0)
    for done in range(1, 801):
        c.agreed(c.ask())
        clock.t += rng.uniform(0.005, 0.06)
        c.tick(done)
        if done == 5:
            c.saved(cad.RAM, 0.003)
            c.saved(cad.STORAGE, 0.004)
    decided = [d for d in log if "measuring" not in d["reasons"].values()]
    assert 1 <= len(decided) <= 6, [(d["memory_every"], d["costs"]["step_s"]) for d in decided]
