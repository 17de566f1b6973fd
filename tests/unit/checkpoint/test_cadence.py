"""The checkpoint cadence rule (trainer.planner.cadence): Young/Daly per tier with the
failure rates each tier covers, the overhead guard, the storage-write floor, the multiple,
bursts, and the journaled decisions. A constant interval fails every one of these."""

from __future__ import annotations

import math

import pytest

from trainer.planner import cadence as cad
from trainer.planner.cadence import Cadence, Costs, Rates, decide

HOUR = 3600.0


def test_young_and_daly_values() -> None:
    assert cad.young(10.0, HOUR) == pytest.approx(math.sqrt(2 * 10 * 3600))  # 268.3 s
    # Daly's form: √(2CM)·[1 + ⅓√(C/2M) + ⅑(C/2M)] − C
    c, m = 300.0, 2 * HOUR
    r = c / (2 * m)
    assert cad.daly(c, m) == pytest.approx(
        math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c
    )
    assert cad.daly(3 * HOUR, HOUR) == HOUR  # C ≥ 2M: no shorter than M
    # small C/M: Young's; large: Daly's (they differ by more than 1 % there)
    assert cad.interval_s(1.0, 1 / (24 * HOUR)) == pytest.approx(cad.young(1.0, 24 * HOUR))
    assert cad.interval_s(c, 1 / m) == pytest.approx(cad.daly(c, m))
    assert abs(cad.daly(c, m) - cad.young(c, m)) / cad.young(c, m) > 0.01
    assert cad.interval_s(5.0, 0.0) == math.inf


def test_each_tier_follows_its_own_cost_and_rate() -> None:
    rates = Rates(memory=2.0, storage=0.05)  # per hour
    base = decide(
        Costs(step_s=1.0, memory_stall_s=0.05, storage_stall_s=2.0),
        rates,
        memory_tier=True,
        max_overhead=1.0,
    )
    want_mem = cad.interval_s(0.05, 2.0 / HOUR)
    assert base.memory_every == math.ceil(want_mem)
    assert base.reasons[cad.RAM] in ("young", "daly")
    # storage: √(2·C·M) for its own rate, rounded to a multiple of the RAM tier's
    want_sto = cad.interval_s(2.0, 0.05 / HOUR)
    assert abs(base.storage_every - want_sto) <= base.memory_every
    assert base.storage_every % base.memory_every == 0
    # four times the storage cost: about twice the interval; the RAM tier's unmoved
    slow = decide(
        Costs(step_s=1.0, memory_stall_s=0.05, storage_stall_s=8.0),
        rates,
        memory_tier=True,
        max_overhead=1.0,
    )
    assert slow.memory_every == base.memory_every
    assert 1.8 < slow.storage_every / base.storage_every < 2.2
    # four times the kills: the RAM tier's interval halves
    kills = decide(
        Costs(step_s=1.0, memory_stall_s=0.05, storage_stall_s=2.0),
        Rates(memory=8.0, storage=0.05),
        memory_tier=True,
        max_overhead=1.0,
    )
    assert kills.memory_every == pytest.approx(base.memory_every / 2, abs=1)
    # the same decision in seconds scales with the step time
    fast = decide(
        Costs(step_s=0.25, memory_stall_s=0.05, storage_stall_s=2.0),
        rates,
        memory_tier=True,
        max_overhead=1.0,
    )
    assert fast.memory_every == pytest.approx(4 * base.memory_every, abs=4)


def test_without_the_memory_tier_storage_covers_every_failure() -> None:
    rates = Rates(memory=2.0, storage=0.05)
    costs = Costs(step_s=1.0, memory_stall_s=0.05, storage_stall_s=2.0)
    on = decide(costs, rates, memory_tier=True, max_overhead=1.0)
    off = decide(costs, rates, memory_tier=False, max_overhead=1.0)
    assert off.memory_every == 0
    assert off.storage_every == math.ceil(cad.interval_s(2.0, 2.05 / HOUR))
    assert off.storage_every < on.storage_every / 4


def test_overhead_guard_lengthens_the_tier() -> None:
    """M = 10 min, C = 10 s: Young says 110 s (9 % stalled); the 2 % guard says 500 s."""
    rates = Rates(memory=0.0, storage=6.0)
    d = decide(Costs(step_s=1.0, storage_stall_s=10.0), rates, memory_tier=False, max_overhead=0.02)
    assert d.storage_every == 500 and d.reasons[cad.STORAGE] == "overhead"
    loose = decide(
        Costs(step_s=1.0, storage_stall_s=10.0), rates, memory_tier=False, max_overhead=0.5
    )
    assert loose.storage_every == math.ceil(cad.interval_s(10.0, 6.0 / HOUR))


def test_never_shorter_than_a_storage_write() -> None:
    rates = Rates(memory=1.0, storage=1.0)
    quick = Costs(step_s=2.0, memory_stall_s=0.01, storage_stall_s=0.5, storage_write_s=10.0)
    slow = Costs(step_s=2.0, memory_stall_s=0.01, storage_stall_s=0.5, storage_write_s=900.0)
    a = decide(quick, rates, memory_tier=True, max_overhead=1.0)
    b = decide(slow, rates, memory_tier=True, max_overhead=1.0)
    assert b.reasons[cad.STORAGE] == "write"
    assert b.storage_every * 2.0 >= 900.0 and b.storage_every % b.memory_every == 0
    assert a.storage_every < b.storage_every


def test_an_unmeasured_tier_saves_once_to_measure() -> None:
    d = decide(Costs(step_s=1.0), Rates(2.0, 0.05), memory_tier=True)
    assert (d.memory_every, d.storage_every) == (1, 1)
    assert set(d.reasons.values()) == {"measuring"}
    log: list[dict] = []
    c = Cadence(Rates(2.0, 0.05), memory_tier=True, journal=lambda e, **f: log.append(f))
    for _ in range(3):
        c.step_time(1.0)
    c.decide_alone()
    assert c.decision.memory_every == 1
    c.saved(cad.RAM, 0.05)
    c.saved(cad.STORAGE, 2.0)
    c.decide_alone()  # at once, not REDECIDE_STEPS later
    assert c.decision.memory_every > 1 and len(log) == 2


def test_a_fixed_tier_keeps_its_number() -> None:
    costs = Costs(step_s=1.0, memory_stall_s=0.05, storage_stall_s=2.0)
    d = decide(costs, Rates(2.0, 0.05), memory_tier=True, fixed_storage=7)
    assert d.storage_every == 7 and d.reasons[cad.STORAGE] == "fixed"


def test_priors_and_drained_notices_count_for_neither() -> None:
    on_demand = cad.prior_rates(64, 1, None)
    spot = cad.prior_rates(64, 1, ">20%")
    # 64 GPUs × 2e-5 per GPU-hour land on the RAM tier (less the pairs)
    assert on_demand.memory + on_demand.storage - cad.DRIVER_FAILURES_PER_HOUR == pytest.approx(
        64 * cad.HARDWARE_FAILURES_PER_GPU_HOUR
    )
    assert spot.memory > on_demand.memory and spot.drained > 0
    assert spot.drained == pytest.approx(64 * 0.25 / 730 * (1 - cad.UNDRAINED_SHARE))
    moved = cad.observed_rates(on_demand, {"preempted": 50}, hours=24)
    assert moved.memory == pytest.approx(on_demand.memory / 2)  # no new fault, twice the hours
    kills = cad.observed_rates(on_demand, {"worker_died": 24}, hours=24)
    assert kills.memory > 0.4 and kills.storage < 0.01
    assert cad.tier_of("node_lost") == cad.RAM and cad.tier_of("driver_lost") == cad.STORAGE


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _cadence(journal: list[dict], clock: Clock, **kw) -> Cadence:
    c = Cadence(
        Rates(memory=2.0, storage=0.05),
        memory_tier=True,
        max_overhead=0.05,
        journal=lambda event, **f: journal.append({"event": event, **f}),
        clock=clock,
        **kw,
    )
    for _ in range(3):
        c.step_time(1.0)
    c.saved(cad.RAM, 0.05)
    c.saved(cad.STORAGE, 2.0)
    return c


def test_the_run_decides_journals_and_moves_with_measurements() -> None:
    log: list[dict] = []
    clock = Clock()
    c = _cadence(log, clock)
    c.decide_alone()
    assert len(log) == 1 and log[0]["event"] == "cadence" and log[0]["why"] == "start"
    first = c.decision
    assert first is not None and first.storage_every % first.memory_every == 0
    assert log[0]["costs"]["storage_stall_s"] == 2.0 and "rates_per_hour" in log[0]
    c.decide_alone()
    assert len(log) == 1  # nothing moved: nothing journaled
    for _ in range(20):  # storage got slow: its interval grows, the RAM tier's does not
        c.saved(cad.STORAGE, 20.0)
    c.decide_alone()
    assert len(log) == 1  # not within REDECIDE_STEPS of the last decision (no flapping)
    for _ in range(Cadence.REDECIDE_STEPS):
        c.step_time(1.0)
    c.decide_alone()
    assert len(log) == 2 and c.decision.storage_every > 2 * first.storage_every
    assert c.decision.memory_every == first.memory_every
    # due: counted from the last save, per tier
    dues = [s for s in range(1, 200) if c.memory_due(s)]
    assert dues[:2] == [c.decision.memory_every, 2 * c.decision.memory_every]


def test_a_burst_shortens_for_a_while() -> None:
    log: list[dict] = []
    clock = Clock()
    c = _cadence(log, clock)
    c.decide_alone()
    calm = c.decision
    c.shorten("rebalance recommendation")
    c.decide_alone()
    assert log[-1]["why"] == "rebalance recommendation" and log[-1]["burst"] is True
    assert c.decision.memory_every <= calm.memory_every / 1.9
    clock.t += cad.BURST_S + 1
    c.decide_alone()
    assert (c.decision.memory_every, c.decision.storage_every) == (
        calm.memory_every,
        calm.storage_every,
    )
    # two faults within BURST_S make a burst too
    c.fault("worker_died", 1.0, {"worker_died": 1})
    assert not c.burst
    c.fault("worker_died", 1.0, {"worker_died": 2})
    assert c.burst


def test_ranks_agree_on_the_mean_of_their_proposals() -> None:
    a, b = _cadence([], Clock()), _cadence([], Clock())
    b.saved(cad.STORAGE, 8.0)
    b.shorten("rebalance recommendation")  # one rank heard it: both shorten
    summed = [x + y for x, y in zip(a.ask(), b.ask(), strict=True)]
    a.agreed(summed)
    b.agreed(summed)
    assert (a.decision.memory_every, a.decision.storage_every) == (
        b.decision.memory_every,
        b.decision.storage_every,
    )
    assert a.decision.inputs["burst"] and b.decision.inputs["burst"]


def test_a_run_starts_from_its_pool_and_its_journal() -> None:
    import time

    now = time.time()
    calm = cad.for_run(
        every_steps="auto",
        memory_every="auto",
        memory_tier=True,
        max_overhead=0.02,
        nodes=64,
        gpus_per_node=1,
        spot_band=">20%",
        journal_records=[],
        journal=None,
    )
    assert calm is not None and not calm.burst
    assert calm.rates.memory == pytest.approx(cad.prior_rates(64, 1, ">20%").memory)
    kills = [{"event": "failure", "cause": "worker_died", "time": now - 600 + i} for i in (0, 60)]
    start = [{"event": "attempt", "time": now - 3600}]
    hurt = cad.for_run(
        every_steps=10,
        memory_every="auto",
        memory_tier=True,
        max_overhead=0.02,
        nodes=64,
        gpus_per_node=1,
        spot_band=">20%",
        journal_records=start + kills,
        journal=None,
    )
    assert hurt.burst and hurt.fixed_storage == 10 and hurt.rates.memory > calm.rates.memory
    assert (
        cad.for_run(
            every_steps=10,
            memory_every=1,
            memory_tier=True,
            max_overhead=0.02,
            nodes=1,
            gpus_per_node=1,
            spot_band=None,
            journal_records=[],
            journal=None,
        )
        is None
    )
