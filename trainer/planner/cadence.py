"""The checkpoint cadence: which steps each tier saves, from measured costs and failure rates.

`checkpoint.every_steps: auto` (storage) and `checkpoint.memory_every: auto` (the RAM tier)
let the run choose its own intervals instead of a guess that is either waste (a stall every
few steps) or risk (a checkpoint interval of the whole cluster lost per fault).

The rule (docs/checkpoints.md):

- Each tier ℓ gets the interval that minimises its expected waste, Young's √(2·Cℓ·Mℓ)
  (Cℓ the tier's blocking cost per save, Mℓ = 1/λℓ the mean time between the failures
  only that tier must cover), in Daly's higher-order form when Cℓ/Mℓ is not small.
- λ of the RAM tier: worker kills and single-node losses (a snapshot on a peer survives
  them). λ of storage: buddy pairs lost together, the cluster's or the driver's loss (the
  RAM tier cannot cover them); with the RAM tier off, storage covers every failure.
  Drained spot notices count for neither: the drain saves at once and loses no step.
- The overhead guard: a tier never stalls training more than `checkpoint.max_overhead`
  of its time (Cℓ/τℓ ≤ max_overhead), measured inflation included.
- The write floor: a tier's interval is never shorter than its background write takes,
  so writes never queue behind each other. Where one is due while the tier's write is
  still in flight on any rank (a write slower than last measured), it waits for that
  write to land, training on, instead of stalling the step (Orbax's and Gemini's way):
  the ranks agree on it through the step's all-reduce.
- The storage interval is a whole multiple of the RAM tier's.
- The wall-time cap: the storage interval (and so the RAM tier's, of which it is a
  multiple) is never longer than `checkpoint.max_interval_s` of training: the priors give
  intervals of hours on small clusters, and a rate the priors underestimate would cost
  that much per fault. It wins over the overhead guard, never over the write floor.
- A tier whose cost is not measured yet saves once at once (CheckFreq's profiling), then
  the rule takes over.
- After a rebalance recommendation or a burst of faults the rates count `BURST_FACTOR`
  times higher for `BURST_S` seconds: the intervals shorten for a while.

Pure Python (no torch): the planner and its simulator (`trainer.planner.faults_sim`) use
the same rule on a laptop. Ranks agree on the intervals through the step's all-reduce
(`ask`/`agreed`), so every rank saves the same steps.

Why one module of about 700 lines: it is one idea, the rule above, in the order it is
applied (the formulas, the failure rates they read, the decision, the run's component
that applies it each step, the setup that seeds it from the journal). The planner's
simulator imports the same names, so a change to the rule changes one file and both the
run and the plan move with it; split by section, each part would be meaningless alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

HARDWARE_FAILURES_PER_GPU_HOUR = 2e-5
"""Unexpected interruptions per GPU-hour: Llama 3's 466 interruptions over 54 days on 16k
H100s (about one every 2.8 h for the cluster) is ~2e-5 per GPU-hour. Worker kills (a GPU
falling off the bus, an OOM kill, a lost NIC) land on the RAM tier."""

SPOT_BANDS: dict[str, float] = {
    "<5%": 0.025,
    "5-10%": 0.075,
    "10-15%": 0.125,
    "15-20%": 0.175,
    ">20%": 0.25,
}
"""AWS's spot interruption frequency bands (share of instances interrupted in a month, per
type and region, from the Spot Instance Advisor) and the monthly rate each stands for (the
band's middle; 25 % for the open top band)."""
HOURS_PER_MONTH = 730.0

UNDRAINED_SHARE = 0.1
"""Share of spot reclaims the drain does not save in time (a notice missed, a node gone
before its two minutes): single-node losses for the RAM tier. The rest are drained."""
PAIR_SHARE = 0.05
"""Share of node losses that take the node's buddy as well (spot reclaims come in waves
over a capacity pool): the snapshot's both copies are gone, storage covers it."""
DRIVER_FAILURES_PER_HOUR = 1.0 / (30 * 24)
"""The head node or the driver lost (on demand): one a month, an assumption stated in
docs/checkpoints.md; storage covers it."""

MAX_INTERVAL_S = 1800.0
"""The default wall-time cap on the storage interval (checkpoint.max_interval_s)."""

BURST_FACTOR = 4.0
"""After a rebalance recommendation or a fault burst the rates count this many times
higher (the intervals halve, √4)..."""
BURST_S = 1800.0
"""...for this long."""
BURST_FAULTS = 2
"""This many faults within BURST_S make a burst (or more where the rates expect more:
`burst_faults`)."""

PRIOR_HOURS = 24.0
"""Weight of the prior in the rate estimate, in hours of observation: a run's own faults
move the rates once it has run about this long."""

RAM, STORAGE = "memory", "storage"
RAM_CAUSES = ("worker_died", "worker_kill", "node_lost", "oom")
STORAGE_CAUSES = ("pair_lost", "cluster_lost", "driver_lost")
DRAINED_CAUSES = ("preempted", "drained")


# ---------------------------------------------------------------- the formulas


def young(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval minimising expected waste to first order, √(2·C·M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006): the higher-order optimum, √(2CM)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C for
    C < 2M, else M (checkpointing more often than failures come helps no more)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return young(cost_s, mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def interval_s(cost_s: float, rate_per_s: float) -> float:
    """The tier's optimal interval in seconds: Young's when C/M is small (< 1e-3, where
    the two agree to 1 %), Daly's otherwise; infinite when nothing fails."""
    if rate_per_s <= 0:
        return math.inf
    mtbf = 1.0 / rate_per_s
    if cost_s <= 0:
        return 0.0
    return young(cost_s, mtbf) if cost_s / mtbf < 1e-3 else daly(cost_s, mtbf)


def expected_waste(interval: float, cost_s: float, rate_per_s: float, restart_s: float) -> float:
    """Expected share of time lost to one tier: its stalls (C/τ) plus, per failure, half an
    interval retrained and the restart (first order, as the planner prints)."""
    if math.isinf(interval):
        return 0.0 if rate_per_s == 0 else 1.0
    if interval <= 0:
        return 1.0
    return cost_s / interval + rate_per_s * (interval / 2.0 + cost_s + restart_s)


# ---------------------------------------------------------------- failure rates


@dataclass
class Rates:
    """Failures per hour of the whole job that each tier must cover."""

    memory: float
    storage: float
    drained: float = 0.0

    def without_memory_tier(self) -> Rates:
        """With no RAM tier storage covers every failure the RAM tier would have."""
        return Rates(0.0, self.memory + self.storage, self.drained)


def spot_rate_per_node_hour(band: str | None) -> float:
    if band is None:
        return 0.0
    return SPOT_BANDS[band] / HOURS_PER_MONTH


def prior_rates(
    nodes: int,
    gpus_per_node: int,
    spot_band: str | None,
    hardware_per_gpu_hour: float = HARDWARE_FAILURES_PER_GPU_HOUR,
    hard_per_hour: float | None = None,
) -> Rates:
    """The rates a run starts from: hardware failures per GPU-hour, the pool's spot band
    (None: on demand), split over the tiers as the module says. `hard_per_hour`
    (checkpoint.failure_rate_per_hour: a drill's or a bench's known rate) replaces the
    hard failures of both, worker kills and undrained losses, split the same way."""
    gpus = max(1, nodes * max(1, gpus_per_node))
    hardware = gpus * hardware_per_gpu_hour
    spot = nodes * spot_rate_per_node_hour(spot_band)
    undrained = spot * UNDRAINED_SHARE
    losses = hardware + undrained if hard_per_hour is None else hard_per_hour
    pair = losses * PAIR_SHARE if nodes > 1 else 0.0
    return Rates(
        memory=losses - pair,
        storage=pair + DRIVER_FAILURES_PER_HOUR,
        drained=spot - undrained,
    )


def burst_faults(rates: Rates) -> int:
    """Faults within BURST_S that make a burst: BURST_FAULTS, or twice what the rates
    expect in that window where that is more. A burst is faults coming faster than the
    rates say; a drill or a bench at a known high rate (checkpoint.failure_rate_per_hour)
    would otherwise be in one from its second fault on, tuned for four times its rate."""
    expected = (rates.memory + rates.storage) * BURST_S / 3600.0
    return max(BURST_FAULTS, round(2.0 * expected))


def tier_of(cause: str) -> str | None:
    """Which tier a journaled failure counts for (None: a drained notice, or not a fault)."""
    if cause in DRAINED_CAUSES:
        return None
    if cause in STORAGE_CAUSES:
        return STORAGE
    if cause in RAM_CAUSES:
        return RAM
    return None


def observed_rates(prior: Rates, faults: dict[str, int], hours: float) -> Rates:
    """The prior updated by what the run (and the cluster's past runs) saw: a Gamma-style
    mean, (prior·PRIOR_HOURS + count) / (PRIOR_HOURS + hours) per tier."""
    count = {RAM: 0, STORAGE: 0}
    for cause, n in faults.items():
        tier = tier_of(cause)
        if tier is not None:
            count[tier] += n
    total = PRIOR_HOURS + max(0.0, hours)
    return Rates(
        memory=(prior.memory * PRIOR_HOURS + count[RAM]) / total,
        storage=(prior.storage * PRIOR_HOURS + count[STORAGE]) / total,
        drained=prior.drained,
    )


# ---------------------------------------------------------------- the decision


@dataclass
class Costs:
    """What a save of each tier costs, in seconds (measured, else the planner's priors)."""

    step_s: float
    """A step's time, on average (the steps a write in flight slows included)."""
    memory_stall_s: float = 0.0
    """The training thread's part of a snapshot (the staging copy)."""
    memory_write_s: float = 0.0
    """A snapshot's trip to the keepers (one in flight at a time)."""
    storage_stall_s: float = 0.0
    storage_write_s: float = 0.0
    """The background write and upload of a storage checkpoint."""
    restart_s: float = 0.0
    memory_inflation_s: float = 0.0
    """The step time a snapshot adds while it travels (its send competes with training
    for cores and memory bandwidth): the steps that began with it in flight, less as
    many steps that began with nothing in flight."""
    storage_inflation_s: float = 0.0
    """The same for a storage checkpoint's background write and upload."""

    def cost(self, tier: str) -> float:
        """What one save of `tier` costs training: its stall and the inflation it causes."""
        if tier == RAM:
            return self.memory_stall_s + self.memory_inflation_s
        return self.storage_stall_s + self.storage_inflation_s


@dataclass
class Decision:
    """The intervals chosen, in steps, with every input that chose them (journaled)."""

    memory_every: int
    storage_every: int
    reasons: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)


def _steps(seconds: float, step_s: float, cap: int) -> int:
    if math.isinf(seconds):
        return cap
    return max(1, min(cap, math.ceil(seconds / max(step_s, 1e-9) - 1e-9)))


def decide(
    costs: Costs,
    rates: Rates,
    *,
    memory_tier: bool,
    max_overhead: float = 0.02,
    max_steps: int = 10**9,
    burst: bool = False,
    fixed_memory: int | None = None,
    fixed_storage: int | None = None,
    max_interval_s: float | None = None,
) -> Decision:
    """The multi-level Young/Daly rule with the overhead guard, the write floor, the
    multiple and the storage tier's wall-time cap (`max_interval_s`, None: none).
    `fixed_*`: a tier the user set to a number keeps it (the other adapts)."""
    r = rates if memory_tier else rates.without_memory_tier()
    factor = BURST_FACTOR if burst else 1.0
    reasons: dict[str, str] = {}

    def tier(name: str, write: float, rate_h: float, cap: float | None) -> int:
        rate_s = rate_h * factor / 3600.0
        stall = costs.cost(name)
        if stall <= 0 and rate_s > 0:  # not measured yet: one save at once measures it
            reasons[name] = "measuring"
            return 1
        optimum = interval_s(stall, rate_s)
        guard = stall / max_overhead if max_overhead > 0 else 0.0
        chosen, why = optimum, "young" if stall * rate_s < 1e-3 else "daly"
        if guard > chosen:
            chosen, why = guard, "overhead"
        if math.isinf(chosen):
            why = "no failures"
        if cap is not None and chosen > cap:
            chosen, why = cap, "max_interval"
        if write > chosen:
            chosen, why = write, "write"
        reasons[name] = why
        return _steps(chosen, costs.step_s, max_steps)

    cap = max_interval_s  # both tiers: storage is a whole multiple of the RAM tier's
    mem = 0
    if memory_tier:
        if fixed_memory is not None:
            mem, reasons[RAM] = fixed_memory, "fixed"
        else:
            mem = tier(RAM, costs.memory_write_s, r.memory, cap)
    if fixed_storage is not None:
        sto, reasons[STORAGE] = fixed_storage, "fixed"
    else:
        sto = tier(STORAGE, costs.storage_write_s, r.storage, cap)
        if mem:
            sto = max(mem, round(sto / mem) * mem)  # a whole multiple of the RAM tier's
            if cap is not None and sto * costs.step_s > max(cap, costs.storage_write_s):
                sto = max(mem, sto - mem)  # rounding up broke the cap
            if sto * costs.step_s < costs.storage_write_s:  # rounding down broke the floor
                sto += mem
    return Decision(
        memory_every=mem,
        storage_every=sto,
        reasons=reasons,
        inputs={
            "costs": {k: round(v, 4) for k, v in asdict(costs).items()},
            "rates_per_hour": {k: round(v, 8) for k, v in asdict(r).items()},
            "max_overhead": max_overhead,
            "max_interval_s": max_interval_s,
            "burst": burst,
        },
    )


# ---------------------------------------------------------------- the run's component


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class Cadence:
    """The loop's cadence component for `auto` intervals. It measures (step time, each
    tier's stall and write), decides again when a measurement moves by more than
    `MOVE` or a burst starts or ends, journals each decision with its inputs, and answers
    `memory_due` / `storage_due`. Ranks agree through `ask`/`agreed` (the step's
    all-reduce sums each rank's proposal; every rank rounds the same mean).

    Its owners tell it what is in flight on this rank (`snapshot_in_flight`, set by the
    RAM tier; `upload_in_flight`, by the runtime's async uploads), and what blocked the
    training thread beyond a save's own stall (`blocked`): a step's time is measured
    without them."""

    MOVE = 0.25
    WARMUP_STEPS = 3
    REDECIDE_STEPS = 20
    STEADY_STEPS = 20

    def __init__(
        self,
        rates: Rates,
        *,
        memory_tier: bool,
        max_overhead: float = 0.02,
        fixed_memory: int | None = None,
        fixed_storage: int | None = None,
        max_interval_s: float | None = MAX_INTERVAL_S,
        prior_costs: Costs | None = None,
        journal: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rates, self.memory_tier, self.max_overhead = rates, memory_tier, max_overhead
        self.fixed_memory, self.fixed_storage = fixed_memory, fixed_storage
        self.max_interval_s = max_interval_s
        self.journal, self.clock = journal, clock
        self.costs = prior_costs or Costs(step_s=0.0)
        self._step_s: float | None = None
        self._burst_until = -math.inf
        self._faults: list[float] = []
        self.decision: Decision | None = None
        self._last = {RAM: 0, STORAGE: 0}
        self._steps_seen = 0
        self._why = "measured"
        self._tick: float | None = None
        self._decided_at = 0
        self._stalled = 0.0
        self._sample: dict[str, tuple[float | None, float]] = {}
        self.snapshot_in_flight: Callable[[], bool] = lambda: False
        self.upload_in_flight: Callable[[], bool] = lambda: False
        self._busy = {RAM: False, STORAGE: False}  # agreed: on any rank
        self._began_busy = {RAM: False, STORAGE: False}  # this rank's, at the step's start
        self._idle_s: float | None = None  # steps begun with no write in flight
        self._busy_s: dict[str, float | None] = {RAM: None, STORAGE: None}
        self._trip = {RAM: 0, STORAGE: 0}  # steps begun while the tier's last save travelled
        self._saves = {RAM: 0, STORAGE: 0}  # this attempt's saves of each tier
        self.deferred = {RAM: 0, STORAGE: 0}
        """Steps at which a save of each tier was due and waited for its write in flight."""

    # -- measurements
    def tick(self, done: int, compute_s: float | None = None) -> None:
        """Step `done` ended: its time is the time since the previous tick less the stalls
        measured meanwhile. The first tick of an attempt is where the intervals count from.
        `compute_s`: the step's own phases (data, forward/backward, optimizer), where the
        loop times them: inflation compares those, so that what a save costs outside the
        step (a report, a first-time set-up) is never read as a slower step."""
        now = self.clock()
        if self._tick is None:
            self._last = {RAM: done - 1, STORAGE: done - 1}
        else:
            seconds = max(1e-6, now - self._tick - self._stalled)
            self.step_time(seconds)
            self._inflation_sample(seconds if compute_s is None else compute_s)
        self._tick, self._stalled = now, 0.0

    def _inflation_sample(self, seconds: float) -> None:
        """A step's time, by what was in flight when it began: the inflation a tier's
        write causes is its steps' time less an idle step's."""
        if not any(self._began_busy.values()):
            self._idle_s = _ema(self._idle_s, seconds, 0.1)
        for tier, busy in self._began_busy.items():
            if busy:
                self._busy_s[tier] = _ema(self._busy_s[tier], seconds)
                self._trip[tier] += 1
            elif self._trip[tier]:  # its write landed before this step began
                self._close_trip(tier)

    def _close_trip(self, tier: str) -> None:
        """The last save of `tier` has landed (or a new one begins): its inflation is the
        steps it slowed times how much slower they ran than idle ones."""
        trip, self._trip[tier] = self._trip[tier], 0
        busy = self._busy_s[tier]
        if self._saves[tier] <= 1:  # the attempt's first: its trip sets things up once
            self._busy_s[tier] = None  # (a keeper, a thread pool), which no later one does
            return
        if trip == 0 or busy is None or self._idle_s is None:
            return
        attr = "memory_inflation_s" if tier == RAM else "storage_inflation_s"
        sample = max(0.0, busy - self._idle_s) * trip
        setattr(self.costs, attr, _ema(getattr(self.costs, attr) or None, sample))

    def step_time(self, seconds: float) -> None:
        """A step's time. The mean follows fast over the first STEADY_STEPS (the warm-up's
        slow steps leave it soon), then slowly: on a shared host single steps vary 2-5x,
        and a mean that followed them moved the intervals in steps by more than MOVE every
        REDECIDE_STEPS, a journal write each time, while the rule's seconds stood still."""
        self._steps_seen += 1
        weight = 0.3 if self._steps_seen <= self.STEADY_STEPS else 0.05
        self._step_s = _ema(self._step_s, seconds, weight)
        self.costs.step_s = self._step_s

    def saved(self, tier: str, stall_s: float) -> None:
        """A save of `tier` stalled the training thread `stall_s` (its staging copy)."""
        self._close_trip(tier)
        self._saves[tier] += 1
        attr = "memory_stall_s" if tier == RAM else "storage_stall_s"
        self._sample[tier] = (getattr(self.costs, attr) or None, 0.0)
        self.blocked(stall_s, tier)

    def blocked(self, seconds: float, tier: str | None = None) -> None:
        """The training thread was blocked `seconds` more outside the step: by the last
        save of `tier` (a synchronous upload: part of that save's stall, one sample), or,
        with no tier, by a wait that is not a cost of the intervals chosen (an upload slot
        under a storage interval the user fixed, the last checkpoint's upload)."""
        self._stalled += seconds
        if tier is None or tier not in self._sample:
            return
        before, total = self._sample[tier]
        self._sample[tier] = (before, total + seconds)
        attr = "memory_stall_s" if tier == RAM else "storage_stall_s"
        setattr(self.costs, attr, _ema(before, total + seconds))

    def written(self, tier: str, seconds: float) -> None:
        if tier == RAM:
            self.costs.memory_write_s = _ema(self.costs.memory_write_s or None, seconds)
        else:
            self.costs.storage_write_s = _ema(self.costs.storage_write_s or None, seconds)

    def fault(self, cause: str, hours_run: float, counts: dict[str, int]) -> None:
        """A fault seen (the journal at an attempt's start): the rates move, and two
        within BURST_S (more where the rates expect more) start a burst."""
        self.rates = observed_rates(self.rates, counts, hours_run)
        now = self.clock()
        self._faults = [t for t in self._faults if now - t < BURST_S] + [now]
        if len(self._faults) >= burst_faults(self.rates):
            self.shorten("fault burst")

    def shorten(self, why: str) -> None:
        """A rebalance recommendation or a fault burst: shorter intervals for BURST_S (the
        ranks' next proposals carry it; the decision is journaled with why)."""
        self._burst_until = self.clock() + BURST_S
        self._why = why

    @property
    def burst(self) -> bool:
        return self.clock() < self._burst_until

    # -- deciding
    def propose(self) -> Decision | None:
        """The decision this rank's measurements give (None until the step time is known)."""
        if self._step_s is None or self._steps_seen < self.WARMUP_STEPS:
            return None
        return decide(
            self.costs,
            self.rates,
            memory_tier=self.memory_tier,
            max_overhead=self.max_overhead,
            burst=self.burst,
            fixed_memory=self.fixed_memory,
            fixed_storage=self.fixed_storage,
            max_interval_s=self.max_interval_s,
        )

    def ask(self) -> list[float]:
        """This rank's proposal for the step's all-reduce: [have one, memory, storage, in a
        burst, a snapshot in flight, an upload in flight]."""
        busy = [float(self.snapshot_in_flight()), float(self.upload_in_flight())]
        self._began_busy = {RAM: bool(busy[0]), STORAGE: bool(busy[1])}
        d = self.propose()
        if d is None:
            return [0.0, 0.0, 0.0, 0.0, *busy]
        return [1.0, float(d.memory_every), float(d.storage_every), float(self.burst), *busy]

    def agreed(self, summed: list[float]) -> None:
        """The proposals summed over ranks: every rank takes the same rounded mean (and a
        burst when any rank is in one). The current intervals stay unless one moved by
        more than MOVE, at most every REDECIDE_STEPS steps (no flapping on a noisy step
        time), or a burst began or ended. Everything here is the same on every rank."""
        n, mem, sto, burst_ranks, mem_busy, sto_busy = summed
        self._busy = {RAM: mem_busy > 0, STORAGE: sto_busy > 0}
        if n < 1:
            return
        burst = burst_ranks > 0
        mem_every = max(1, round(mem / n)) if self.memory_tier else 0
        sto_every = max(1, round(sto / n))
        if mem_every and self.fixed_storage is None:  # a number the user set stays that
            sto_every = max(mem_every, round(sto_every / mem_every) * mem_every)
        old = self.decision
        if old is not None and old.inputs.get("burst") == burst:
            measuring = "measuring" in old.reasons.values()
            if not measuring and self._steps_seen - self._decided_at < self.REDECIDE_STEPS:
                return
            moved = [
                abs(new - cur) > self.MOVE * cur
                for new, cur in ((mem_every, old.memory_every), (sto_every, old.storage_every))
                if cur
            ]
            if not any(moved):
                return
        self._decide((mem_every, sto_every), burst)

    def _decide(self, agreed: tuple[int, int], burst: bool) -> None:
        d = self.propose()
        if d is None:
            return
        why = self._why if burst else ("start" if self.decision is None else "measured")
        d.memory_every, d.storage_every = agreed
        d.inputs["burst"] = burst
        self.decision, self._decided_at = d, self._steps_seen
        if self.journal is not None:
            self.journal(
                "cadence",
                why=why,
                memory_every=d.memory_every,
                storage_every=d.storage_every,
                reasons=d.reasons,
                deferred=dict(self.deferred),
                **d.inputs,
            )

    def decide_alone(self) -> None:
        """Single-process use (the simulator, tests): agree with nobody but oneself."""
        self.agreed(self.ask())

    # -- answering
    def _due(self, tier: str, done: int) -> bool:
        d = self.decision
        if d is None:
            return False
        every = d.memory_every if tier == RAM else d.storage_every
        if every <= 0 or done - self._last[tier] < every:
            return False
        if self._busy[tier]:  # its write is still in flight on some rank: train on
            self.deferred[tier] += 1
            return False
        self._last[tier] = done
        return True

    def memory_due(self, done: int) -> bool:
        return self._due(RAM, done)

    def storage_due(self, done: int) -> bool:
        return self._due(STORAGE, done)

    def restored(self, step: int) -> None:
        """A new attempt starts from `step`: intervals count from there."""
        self._last = {RAM: step, STORAGE: step}


# ---------------------------------------------------------------- the run's setup


MARKET_LABELS = ("ray.io/market-type", "market")
INSTANCE_TYPE_LABELS = ("instance-type", "ray.io/instance-type")


def spot_band_of(labels: dict[str, str]) -> str | None:
    """The spot band of the node's instance type (the catalog's), None on demand or
    where the catalog names none."""
    market = next((labels[k] for k in MARKET_LABELS if labels.get(k)), "")
    itype = next((labels[k] for k in INSTANCE_TYPE_LABELS if labels.get(k)), "")
    if market.lower() != "spot":
        return None
    from trainer.planner.catalog import load_instances

    spec = load_instances().get(itype)
    return getattr(spec, "spot_interruption_band", None) if spec is not None else None


def journal_faults(records: list[dict[str, Any]]) -> tuple[dict[str, int], float]:
    """({cause: count}, hours of training) from a run's journal: the controller's failure
    causes, a driver lost (an attempt after a failure with no controller record, a new
    driver before it)."""
    counts: dict[str, int] = {}
    attempts = [r for r in records if r.get("event") == "attempt"]
    for r in records:
        if r.get("event") == "failure":
            cause = str(r.get("cause"))
            counts[cause] = counts.get(cause, 0) + 1
    times = [float(r["time"]) for r in records if "time" in r]
    hours = (max(times) - min(times)) / 3600 if len(times) > 1 else 0.0
    failures = sum(1 for a in attempts[1:] if a.get("after") == "failure")
    counted = sum(counts.values())
    if failures > counted:
        counts["driver_lost"] = failures - counted
    return counts, hours


def for_run(
    *,
    every_steps: int | str | None,
    memory_every: int | str,
    memory_tier: bool,
    max_overhead: float,
    nodes: int,
    gpus_per_node: int,
    spot_band: str | None,
    journal_records: list[dict[str, Any]],
    journal: Callable[..., Any] | None,
    max_interval_s: float | None = MAX_INTERVAL_S,
    failure_rate_per_hour: float | None = None,
    past: tuple[dict[str, int], float] | None = None,
) -> Cadence | None:
    """The run's cadence when either tier is `auto` (None when both are numbers): priors
    from the pool (or checkpoint.failure_rate_per_hour), moved by the run's own journal
    and by `past`: the faults and hours (as this job's) of the cluster's past runs on its
    pool (trainer.planner.fault_history), pooled with the run's own."""
    if every_steps != "auto" and memory_every != "auto":
        return None
    rates = prior_rates(nodes, gpus_per_node, spot_band, hard_per_hour=failure_rate_per_hour)
    counts, hours = journal_faults(journal_records)
    if past is not None:
        for cause, n in past[0].items():
            counts[cause] = counts.get(cause, 0) + n
        hours += past[1]
    rates = observed_rates(rates, counts, hours)
    cadence = Cadence(
        rates,
        prior_costs=journaled_costs(journal_records),
        memory_tier=memory_tier,
        max_overhead=max_overhead,
        max_interval_s=max_interval_s,
        fixed_memory=memory_every if isinstance(memory_every, int) and memory_tier else None,
        fixed_storage=(
            every_steps
            if isinstance(every_steps, int)
            else (10**9 if every_steps is None else None)
        ),
        journal=journal,
    )
    # Two faults within BURST_S before this attempt (more where the rates expect more): a
    # burst, shorter intervals for a while.
    failed = sorted(float(r["time"]) for r in journal_records if r.get("event") == "failure")
    n = burst_faults(rates)
    recent = len(failed) >= n and time.time() - failed[-1] < BURST_S
    if recent and failed[-1] - failed[-n] < BURST_S:
        cadence.shorten("fault burst")
    return cadence


def journaled_costs(records: list[dict[str, Any]]) -> Costs | None:
    """The costs the run's last journaled decision measured (None before any): a restarted
    attempt starts from them, measuring on. Without them every attempt would measure again
    from nothing, a snapshot and a storage save at its first steps and intervals too short
    until each tier's second trip measured its inflation: with four attempts in a run that
    was 35-54 snapshots and 20-25 storage saves against 29 and 8 for similar intervals
    set by number (the cadence bench on the development VM)."""
    last = next((r.get("costs") for r in reversed(records) if r.get("event") == "cadence"), None)
    if not isinstance(last, dict):
        return None
    known = {f.name for f in fields(Costs)}
    try:
        costs = Costs(**{k: float(v) for k, v in last.items() if k in known})
    except (TypeError, ValueError):  # a journal from another version: measure afresh
        return None
    return costs if costs.memory_stall_s > 0 or costs.storage_stall_s > 0 else None


def memory_tier_on(cfg: Any, ray_train: bool) -> bool:
    """Whether the RAM tier runs: a number > 0, or auto where it can (Ray Train, not
    DeepSpeed: its engine writes only whole checkpoints to a folder)."""
    every = cfg.checkpoint.memory_every
    if every == "auto":
        return ray_train and cfg.strategy.name != "deepspeed"
    return ray_train and every > 0
