"""Goodput replayed: the simulator's model of a run (trainer.planner.faults_sim) given a fault
schedule instead of sampled failures, step by step, with the run's own cadence component.

`faults_sim` draws failures from Poisson processes and takes each tier's interval as fixed,
its phase averaged. A replay takes the faults a run met (the step each attempt ended at, its
cause, what the restart took) and the costs each attempt measured, and runs the same steps
through `trainer.planner.cadence.Cadence` on a clock of its own: the same warm-up, the
same "measuring" saves at the first attempt's start (a later one starts from the costs
the last journaled decision measured), the same Young/Daly decisions and burst after
two faults, the writes landing `*_write_s` after their saves. A save that comes due while
its tier's write is in flight waits for it to land, training on (the cadence's deferral:
what is in flight is sampled at each step's start, as the ranks' all-reduce does); one
that must be taken then (a tier's interval fixed) blocks until the write in flight lands,
as the RAM tier's one send and the runtime's one upload slot do. At a fault
the attempt resumes from the newest save that had landed: a worker kill or a node loss
from the newer of the RAM tier's snapshot and the storage checkpoint, a buddy pair, the
cluster or the driver from storage, a drained notice from the emergency checkpoint at
the step itself. It predicts the steps each fault loses
and the runtime goodput (kept steps' time over the wall time), which the cluster test
(tests/integration/test_cadence_faults.py) holds against what the run measured.

Pure Python (no numpy): the planner's room.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from trainer.planner.cadence import (
    BURST_S,
    DRAINED_CAUSES,
    MAX_INTERVAL_S,
    RAM,
    STORAGE,
    STORAGE_CAUSES,
    Cadence,
    Rates,
    burst_faults,
    journaled_costs,
    observed_rates,
)


@dataclass
class Attempt:
    """One attempt as the run measured it, and how it ended."""

    step_s: float
    """Wall time per step (the step, its report, everything but checkpoint stalls)."""
    memory_stall_s: float = 0.0
    memory_write_s: float = 0.0
    storage_stall_s: float = 0.0
    storage_write_s: float = 0.0
    end_step: int | None = None
    """The last step it finished before a fault ended it (None: it ran to the end)."""
    cause: str = "worker_died"
    """The fault's cause as the journal names it (worker_died, node_lost, preempted, ...)."""
    restart_s: float = 0.0
    """From its last step to the next attempt's first step: noticing the fault, a new
    worker group's start-up and its restore (an emergency checkpoint's wait included)."""
    memory_inflation_s: float = 0.0
    """The step time a snapshot in flight added, as the run's cadence measured it (the
    replay's clock has no contention to measure: once a tier's second write has landed,
    as in the run, its cadence takes the run's figure)."""
    storage_inflation_s: float = 0.0
    storage_writes: list[float] = field(default_factory=list)
    """Each storage save's write in order, where the run measured them one by one (a
    slowdown that came and went); past the list's end, `storage_write_s`."""
    settled: bool = False
    """The fault came once every save in flight had landed (a drill's kill that waits for
    them: RAYLIFT_FAULT_KILL_AFTER_STEP=N:settled): the waiting is part of `restart_s`."""


@dataclass
class Replayed:
    lost_steps: int
    """Steps trained and thrown away, summed over the faults."""
    resumed_from: list[int]
    """The step each later attempt resumed from."""
    wall_s: float
    kept_s: float
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """The cadence's journaled decisions, with the attempt each was made in."""

    @property
    def goodput(self) -> float:
        return self.kept_s / self.wall_s if self.wall_s > 0 else 0.0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(
    attempts: list[Attempt],
    *,
    steps: int,
    rates: Rates,
    memory_tier: bool = True,
    max_overhead: float = 0.02,
    max_interval_s: float | None = MAX_INTERVAL_S,
    start_s: float = 0.0,
    tail_s: float = 0.0,
) -> Replayed:
    """The run `attempts` describe, to step `steps`: every attempt but the last ends at its
    `end_step` with its `cause`. `rates`: the prior the run started from (its journal's
    faults move them as the run's do); `start_s`/`tail_s`: the wall time before the first
    step and after the last."""
    clock = _Clock()
    clock.t = start_s
    failures: list[tuple[float, str]] = []  # (time, cause): the journal's failure records
    snaps: list[tuple[float, int]] = []  # (landed at, step) of each RAM-tier snapshot
    checkpoints: list[tuple[float, int]] = []  # (landed at, step) of each storage save
    decisions: list[dict[str, Any]] = []
    step, lost, resumed, kept_step_s = 0, 0, [], {}
    for n, a in enumerate(attempts):
        cadence = _cadence_for(n, rates, failures, clock, decisions, memory_tier)
        cadence.max_overhead, cadence.max_interval_s = max_overhead, max_interval_s
        last = a.end_step if a.end_step is not None and n < len(attempts) - 1 else steps
        inflight = {RAM: 0.0, STORAGE: 0.0}  # when each tier's write in flight lands
        writes: list[tuple[float, str, float]] = []  # (lands at, tier, seconds) to report
        cadence.snapshot_in_flight = lambda f=inflight: f[RAM] > clock.t
        cadence.upload_in_flight = lambda f=inflight: f[STORAGE] > clock.t
        owed = 0.0  # the saves' inflation not yet taken from the steps after them
        arrived = {RAM: 0, STORAGE: 0}  # writes of each tier landed in this attempt
        while step < last:
            while writes and writes[0][0] <= clock.t:  # a write landed: the floor learns it
                _, tier, took = heapq.heappop(writes)
                cadence.written(tier, took)
                arrived[tier] += 1
                if arrived[tier] < 2:  # the run measures inflation from its second trip on
                    continue
                if tier == RAM:  # and the inflation its trip caused
                    cadence.costs.memory_inflation_s = a.memory_inflation_s
                else:
                    cadence.costs.storage_inflation_s = a.storage_inflation_s
            asked = cadence.ask()  # at the step's start, into the step's all-reduce
            clock.t += a.step_s
            step += 1
            # a step's time less the inflation it carries, as the goodput split charges
            # each save's measured inflation to its tier (trainer.observability.goodput)
            take = min(owed, a.step_s)
            kept_step_s[step], owed = a.step_s - take, owed - take
            cadence.agreed(asked)
            # the loop's order: the storage checkpoint, then the tick, then the snapshot
            if cadence.storage_due(step):
                landed = _save(cadence, clock, STORAGE, a, inflight, writes)
                checkpoints.append((landed, step))
                owed += a.storage_inflation_s
            cadence.tick(step)
            if memory_tier and cadence.memory_due(step):
                snaps.append((_save(cadence, clock, RAM, a, inflight, writes), step))
                owed += a.memory_inflation_s
        if n == len(attempts) - 1 or step >= steps:
            break
        fault_t = max(clock.t, *inflight.values()) if a.settled else clock.t
        back = _resume_point(a.cause, step, fault_t, snaps, checkpoints)
        lost += step - back
        resumed.append(back)
        failures.append((clock.t, a.cause))
        # what the lost steps were is retrained; the saves after the resume point are gone
        snaps = [(t, s) for t, s in snaps if s <= back and t <= fault_t]
        checkpoints = [(t, s) for t, s in checkpoints if s <= back and t <= fault_t]
        step = back
        clock.t = max(clock.t + a.restart_s, fault_t)
    wall = clock.t + tail_s
    kept = sum(kept_step_s[s] for s in range(1, step + 1))
    return Replayed(lost, resumed, wall, kept, decisions)


def _save(
    cadence: Cadence,
    clock: _Clock,
    tier: str,
    a: Attempt,
    inflight: dict[str, float],
    writes: list[tuple[float, str, float]],
) -> float:
    """One save of `tier`: stall, start the write; returns when the write lands. A save
    taken while its tier's write is in flight first waits for it (the RAM tier sends
    one snapshot at a time; the runtime has one upload slot): not the step's time."""
    if inflight[tier] > clock.t:
        cadence.blocked(inflight[tier] - clock.t)
        clock.t = inflight[tier]
    stall = a.memory_stall_s if tier == RAM else a.storage_stall_s
    write = a.memory_write_s
    if tier == STORAGE:
        write = a.storage_writes.pop(0) if a.storage_writes else a.storage_write_s
    clock.t += stall
    cadence.saved(tier, stall)
    inflight[tier] = clock.t + write
    heapq.heappush(writes, (inflight[tier], tier, inflight[tier] - clock.t))
    return inflight[tier]


def _cadence_for(
    n: int,
    prior: Rates,
    failures: list[tuple[float, str]],
    clock: _Clock,
    decisions: list[dict[str, Any]],
    memory_tier: bool,
) -> Cadence:
    """The attempt's cadence as trainer.planner.cadence.for_run builds it: the prior
    moved by the faults so far, the costs of the last decision journaled, and a burst when
    enough came within BURST_S."""
    counts: dict[str, int] = {}
    for _, cause in failures:
        counts[cause] = counts.get(cause, 0) + 1
    rates = observed_rates(prior, counts, clock.t / 3600.0)

    def journal(event: str, **fields: Any) -> None:
        decisions.append({"event": event, "attempt": n + 1, **fields})

    cadence = Cadence(
        rates,
        memory_tier=memory_tier,
        journal=journal,
        clock=clock,
        prior_costs=journaled_costs(decisions),
    )
    times = [t for t, _ in failures]
    need = burst_faults(rates)
    if len(times) >= need and clock.t - times[-1] < BURST_S and times[-1] - times[-need] < BURST_S:
        cadence.shorten("fault burst")
    return cadence


def _resume_point(
    cause: str,
    step: int,
    now: float,
    snaps: list[tuple[float, int]],
    checkpoints: list[tuple[float, int]],
) -> int:
    """Where an attempt ended by `cause` at `step` resumes: the newest save landed by `now`
    that the fault left (see the module)."""
    if cause in DRAINED_CAUSES:
        return step  # the emergency checkpoint of the step the notice came at
    stored = max((s for t, s in checkpoints if t <= now), default=0)
    if cause in STORAGE_CAUSES:
        return stored
    return max(stored, max((s for t, s in snaps if t <= now), default=0))
