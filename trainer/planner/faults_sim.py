"""Goodput predicted: a seeded Monte Carlo of failures over a run, for the cadence `auto`
chooses (trainer.planner.cadence, the same rule the run uses) against fixed intervals.

A run of `days` on `nodes` nodes trains steps of `step_s` seconds; every `memory_every`
steps the RAM tier costs it `memory_stall_s` and the inflation its trip causes
(`Costs.cost`), every `storage_every` steps storage its own. Failures arrive as Poisson
processes at the rates each tier covers
(trainer.planner.cadence.prior_rates): a RAM-tier failure (a worker kill, a node lost)
restores the newest snapshot (with the RAM tier off, the newest storage checkpoint); a
storage failure (a buddy pair, the cluster, the driver) the newest storage checkpoint, or
step 0 when storage saves only at the end; a drained notice loses no step. Each failure
costs a restart (new node, start-up) and the restore. Goodput is the kept steps' time over
the wall time; dollars are node-hours at the pool's price. The intervals' phase is taken
as the average (a step costs step_s + C_mem/m + C_sto/k): a first-order simplification,
stated in docs/checkpoints.md.

Pure Python with `random` (no numpy): `raylift plan` runs it on a laptop. The same model
given a run's fault schedule instead of sampled failures, step by step with the run's own
cadence component: `trainer.planner.faults_replay`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.planner.cadence import (
    MAX_INTERVAL_S,
    RAM,
    STORAGE,
    Costs,
    Rates,
    decide,
    prior_rates,
)

RESTART_S = 300.0
"""A failure's restart before the restore: the controller notices, a replacement node
boots and joins, the workers start and load the model (an assumption, docs/checkpoints.md)."""
DRAIN_RESTART_S = 180.0
"""A drained notice's restart: the capacity is found elsewhere, the workers start again."""
HOST_COPY_BPS = 4e9
"""Bytes per second a rank stages its state into host memory (the snapshot's stall)."""
PEER_BPS = 1e9
"""Bytes per second a node sends a snapshot to its keepers and buddy (10 Gb/s links)."""
STORAGE_BPS = 0.5e9
"""Bytes per second a node writes to or reads from S3."""
MEMORY_RESTORE_BPS = 2e9


@dataclass
class Scenario:
    nodes: int
    gpus_per_node: int
    days: float
    step_s: float
    costs: Costs
    rates: Rates
    usd_per_node_hour: float | None = None
    memory_restore_s: float = 5.0
    storage_restore_s: float = 60.0
    memory_tier: bool = True
    restart_s: float = RESTART_S
    """A failure's restart before the restore (a bench passes the one it measured)."""
    rates_from: str = ""
    """Which rates, from what (the prior, the past runs on the pool): one line for the plan."""


@dataclass
class Outcome:
    memory_every: int
    storage_every: int | None
    goodput: float
    goodput_p10: float
    goodput_p90: float
    lost_steps_per_day: float
    failures_per_day: float
    usd: float | None
    usd_lost: float | None
    trials: list[float] = field(default_factory=list, repr=False)


def _one(s: Scenario, m: int, k: int | None, rng: random.Random) -> tuple[float, int, int]:
    """One run: (goodput, steps lost, failures)."""
    wall = s.days * 86400.0
    c = s.costs
    per_step = s.step_s + (c.cost(RAM) / m if m else 0.0)  # stall and inflation per save
    per_step += c.cost(STORAGE) / k if k else 0.0
    rate_mem = s.rates.memory / 3600.0
    rate_sto = s.rates.storage / 3600.0
    rate_drain = s.rates.drained / 3600.0
    total = rate_mem + rate_sto + rate_drain
    t, step, lost, failures = 0.0, 0, 0, 0
    while t < wall:
        gap = rng.expovariate(total) if total > 0 else math.inf
        if t + gap >= wall:
            step += int((wall - t) / per_step)
            break
        n = int(gap / per_step)
        reached = step + n
        u = rng.random() * total
        storage_back = (reached // k) * k if k else 0
        if u < rate_drain:
            back, cost = reached, DRAIN_RESTART_S + s.storage_restore_s
        elif u < rate_drain + rate_mem and m:
            back, cost = max((reached // m) * m, storage_back), s.restart_s + s.memory_restore_s
        else:
            back, cost = storage_back, s.restart_s + s.storage_restore_s
        lost += reached - back
        failures += 1
        step = back
        t += gap + cost
    return step * s.step_s / wall, lost, failures


def simulate(
    s: Scenario, memory_every: int, storage_every: int | None, seed: int = 0, trials: int = 200
) -> Outcome:
    """`trials` runs of the scenario, seeded: the mean goodput, its 10th and 90th
    percentiles, the steps lost and failures per day, and the dollars (all, and those the
    goodput did not buy)."""
    m = memory_every if s.memory_tier else 0
    rng = random.Random(seed)
    runs = [_one(s, m, storage_every, rng) for _ in range(trials)]
    goods = sorted(g for g, _, _ in runs)
    mean = sum(goods) / len(goods)
    usd = None
    if s.usd_per_node_hour is not None:
        usd = s.days * 24 * s.nodes * s.usd_per_node_hour
    return Outcome(
        memory_every=m,
        storage_every=storage_every,
        goodput=mean,
        goodput_p10=goods[len(goods) // 10],
        goodput_p90=goods[(9 * len(goods)) // 10],
        lost_steps_per_day=sum(x for _, x, _ in runs) / len(runs) / s.days,
        failures_per_day=sum(f for _, _, f in runs) / len(runs) / s.days,
        usd=usd,
        usd_lost=None if usd is None else usd * (1 - mean),
        trials=goods,
    )


def auto_intervals(
    s: Scenario, max_overhead: float = 0.02, max_interval_s: float | None = MAX_INTERVAL_S
) -> tuple[int, int]:
    d = decide(
        replace(s.costs, step_s=s.step_s),
        s.rates,
        memory_tier=s.memory_tier,
        max_overhead=max_overhead,
        max_interval_s=max_interval_s,
    )
    return d.memory_every, d.storage_every


FIXED = ((0, None), (0, 100), (0, 500), (1, 100), (10, 500), (50, 1000))
"""Fixed (memory_every, every_steps) to compare with: the old defaults first (no RAM tier,
storage only at the end), then hand-picked ones users write."""


def compare(
    s: Scenario, seed: int = 0, trials: int = 200, fixed: tuple[tuple[int, int | None], ...] = FIXED
) -> dict[str, Outcome]:
    """auto against fixed intervals on the same seeded failures."""
    m, k = auto_intervals(s)
    out = {"auto": simulate(s, m, k, seed, trials)}
    for fm, fk in fixed:
        if fm and not s.memory_tier:
            continue
        name = f"memory_every {fm or 'off'}, every_steps {fk or 'end only'}"
        out[name] = simulate(s, fm, fk, seed, trials)
    return out


# ---------------------------------------------------------------- from a plan


def scenario_for_plan(
    cfg: Any,
    plan: Any,
    days: float,
    nodes: int | None = None,
    market: str = "spot",
    past: Any = None,
) -> Scenario | None:
    """The scenario a plan describes: its layout's nodes (or `nodes` of its node type),
    the state bytes it stages per rank, its throughput and price; None without a layout.
    `past` (trainer.planner.fault_history.Reading): the past runs under storage.path,
    whose faults on the node type's pool move the rates as they move a run's."""
    lay = plan.layout or plan.cheapest
    if lay is None:
        return None
    from trainer.planner.catalog import get_instance

    node = lay.nodes[-1]
    spec = get_instance(node.instance)
    per_node = max(1, node.ranks_per_node)
    n_nodes = nodes or sum(x.count for x in lay.nodes)
    world = n_nodes * per_node
    share = plan.host.staging + plan.host.staging_rank0 / max(1, world)
    node_bytes = share * per_node
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * world
    tokens_per_step *= cfg.data.block_size
    tps = (lay.tokens_per_s or 0.0) * world / max(1, lay.world)
    step_s = tokens_per_step / tps if tps > 0 else 10.0
    band = spec.spot_interruption_band if market == "spot" else None
    on = cfg.checkpoint.memory_every not in (0, "auto") and cfg.strategy.name != "deepspeed"
    if cfg.checkpoint.memory_every == "auto":  # where the keepers fit the node's RAM
        from trainer.planner.shape import GIB
        from trainer.planner.tiers import memory_tier_fits

        on = memory_tier_fits(cfg, spec.ram_gib * GIB, per_node)[0]
    costs = Costs(
        step_s=step_s,
        memory_stall_s=share / HOST_COPY_BPS,
        memory_write_s=2 * node_bytes / PEER_BPS,
        storage_stall_s=share / HOST_COPY_BPS,
        storage_write_s=node_bytes / STORAGE_BPS,
    )
    rates = prior_rates(
        n_nodes, max(1, spec.gpu_count), band, hard_per_hour=cfg.checkpoint.failure_rate_per_hour
    )
    rates_from = ""
    if past is not None:
        from trainer.planner import fault_history

        rates, rates_from = fault_history.plan_rates(
            rates, past, node.instance, market, n_nodes, band, cfg.checkpoint.failure_rate_per_hour
        )
    return Scenario(
        nodes=n_nodes,
        gpus_per_node=max(1, spec.gpu_count),
        days=days,
        step_s=step_s,
        costs=costs,
        rates=rates,
        rates_from=rates_from,
        usd_per_node_hour=spec.usd_per_hour("spot" if market == "spot" else "on-demand"),
        memory_restore_s=node_bytes / MEMORY_RESTORE_BPS,
        storage_restore_s=node_bytes / STORAGE_BPS,
        memory_tier=on,
    )


def plan_lines(
    cfg: Any, plan: Any, days: float | None, nodes: int | None, seed: int = 0, past: Any = None
) -> list[str]:
    """What `raylift plan` prints under the plan: the expected goodput and cost of faults
    on spot (one day when `days` is not given), and with `days`/`nodes`, auto against
    fixed intervals. With `past` (the runs under storage.path), which rates, from what."""
    s = scenario_for_plan(cfg, plan, days or 1.0, nodes, past=past)
    if s is None:
        return []
    m, k = auto_intervals(s)
    quick = simulate(s, m, k, seed, trials=100)
    band = "on demand" if s.rates.drained == 0 else "spot"
    money = (
        f", ${quick.usd:,.0f} of which faults and checkpoints take ${quick.usd_lost:,.0f}"
        if quick.usd is not None
        else ""
    )
    lines = [
        f"goodput (simulated, {s.nodes} nodes on {band}, {s.days:g} days, step {s.step_s:.1f} s"
        f"): {quick.goodput:.1%} expected (p10 {quick.goodput_p10:.1%}){money}; "
        f"{quick.failures_per_day:.1f} failures a day; auto intervals: "
        + (f"RAM tier every {m} steps, " if m else "RAM tier off, ")
        + f"storage every {k} steps"
    ]
    if s.rates_from:
        lines.append(s.rates_from)
    if days is None and nodes is None:
        return lines
    for name, o in compare(s, seed).items():
        usd = "" if o.usd_lost is None else f", ${o.usd_lost:,.0f} lost"
        lines.append(
            f"  {name:<44} goodput {o.goodput:6.1%} (p10 {o.goodput_p10:.1%}){usd}, "
            f"{o.lost_steps_per_day:,.0f} steps lost a day"
        )
    return lines
