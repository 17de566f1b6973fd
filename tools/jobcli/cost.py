"""What a run cost: instance-hours and dollars per pool, and what its faults wasted.

The nodes come from the run's own record (`<run>/nodes/*.json`, written by its driver:
trainer.autoscaling.watch): each worker node's pool, market and instance type (Ray labels
that infra's boot script sets) and when the driver first and last saw it. Prices are the
instance catalog's (trainer/planner/catalog/instances.yaml: on demand, or its typical spot
figure). The hours count from when the node's Ray joined to when the driver last saw it
(polled every few seconds): EC2 also bills the boot before Ray starts, and the idle timeout
after the run, which no run can see. Nothing is invented: a node with no pool (a local
cluster) or no instance type is said so, not priced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RANK0_POOL = "large-cpu-mem"
"""infra's pool for rank 0 (infra/settings.py)."""


@dataclass
class PoolCost:
    pool: str
    market: str | None
    nodes: int = 0
    hours: float = 0.0
    usd: float | None = 0.0
    types: set[str] = field(default_factory=set)


def price_nodes(nodes: list[dict[str, Any]]) -> tuple[dict[str, PoolCost], list[str]]:
    """Per pool: nodes, instance-hours and dollars; and notes on what could not be priced."""
    from trainer.planner.catalog import load_instances

    instances = load_instances()
    pools: dict[str, PoolCost] = {}
    notes: list[str] = []
    for n in nodes:
        if not n.get("pool"):
            continue
        pc = pools.setdefault(n["pool"], PoolCost(n["pool"], n.get("market")))
        hours = max(0.0, float(n["last"]) - float(n["first"])) / 3600
        pc.nodes += 1
        pc.hours += hours
        itype = n.get("instance_type")
        if itype:
            pc.types.add(itype)
        spec = instances.get(itype or "")
        if spec is None or pc.usd is None:
            if pc.usd is not None:
                notes.append(
                    f"pool {pc.pool}: instance type {itype or 'not recorded'} has no catalog "
                    "price; not priced"
                )
            pc.usd = None
            continue
        market = "spot" if n.get("market") == "spot" else "on-demand"
        pc.usd += hours * spec.usd_per_hour(market)
    return pools, notes


def step_seconds(steps: list[dict[str, Any]]) -> float | None:
    """Wall seconds per step over the run's train records (their `time` stamps)."""
    timed = [r for r in steps if r.get("time") is not None]
    if len(timed) < 2 or timed[-1]["step"] <= timed[0]["step"]:
        return None
    return (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])


def cost_lines(
    nodes: list[dict[str, Any]], steps: list[dict[str, Any]], lost_steps: int
) -> list[str]:
    """The run's cost as summary lines (the end of `raylift run`, `status`, `report`)."""
    if not nodes:
        return [
            "cost: no nodes recorded for this run (recorded by its driver from this version on)"
        ]
    if not any(n.get("instance_type") for n in nodes):
        hours: dict[str, float] = {}
        for n in nodes:
            pool = n.get("pool") or "no pool"
            hours[pool] = hours.get(pool, 0.0) + (n["last"] - n["first"]) / 3600
        by_pool = ", ".join(f"{p} {h:.2f}" for p, h in sorted(hours.items()))
        return [
            "cost: this cluster's nodes carry no instance type (a local cluster): nothing to "
            f"price; instance-hours by pool: {by_pool}"
        ]
    pools, notes = price_nodes(nodes)
    lines = []
    total = 0.0
    priced = True
    for pc in sorted(pools.values(), key=lambda p: p.pool):
        types = ", ".join(sorted(pc.types)) or "type not recorded"
        usd = "not priced" if pc.usd is None else f"${pc.usd:,.2f}"
        lines.append(
            f"cost: {pc.pool} ({pc.market or '?'}; {types}): {pc.nodes} nodes, "
            f"{pc.hours:.2f} instance-hours, {usd}"
        )
        if pc.usd is None:
            priced = False
        else:
            total += pc.usd
    span_h = (max(n["last"] for n in nodes) - min(n["first"] for n in nodes)) / 3600
    lines.append(
        f"cost: {'$' + format(total, ',.2f') if priced else 'at least $' + format(total, ',.2f')}"
        f" for {sum(p.hours for p in pools.values()):.2f} instance-hours over "
        f"{span_h:.2f} h (catalog prices; boot and idle-timeout time not counted)"
    )
    step_s = step_seconds(steps)
    if lost_steps and step_s:
        wasted_h = lost_steps * step_s / 3600
        rate = total / span_h if span_h > 0 else 0.0
        lines.append(
            f"cost: faults wasted {lost_steps} steps × {step_s:.1f} s = {wasted_h * 60:.1f} "
            f"min of the whole cluster, about ${wasted_h * rate:,.2f}"
        )
    elif lost_steps:
        lines.append(f"cost: faults wasted {lost_steps} steps (step time unknown)")
    return lines + [f"cost: {n}" for n in notes]


def planner_lines(
    job: dict[str, Any] | None, nodes: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> list[str]:
    """The planner's estimate for what the run trained, on the instance types it ran on:
    hours and dollars for its tokens at the planner's tokens/s (one line), or nothing
    where the run has no job record, no priced nodes or no tokens."""
    from collections import Counter

    from trainer.config import JobConfig
    from trainer.planner.plan import plan_job

    types = Counter(n["instance_type"] for n in nodes if n.get("instance_type"))
    tokens = max((int(r.get("tokens_seen") or 0) for r in steps), default=0)
    if not job or not types or not tokens:
        return []
    # Rank 0's node comes from infra's large-cpu-mem pool (its own instance type).
    rank0 = [
        n["instance_type"] for n in nodes if n.get("pool") == RANK0_POOL and n.get("instance_type")
    ]
    workers = Counter(
        n["instance_type"] for n in nodes if n.get("instance_type") and n.get("pool") != RANK0_POOL
    )
    instance = (workers or types).most_common(1)[0][0]
    try:
        cfg = JobConfig.model_validate(job["config"])
        lay = plan_job(
            cfg, instance, rank0_instance=rank0[0] if rank0 else None, params=job.get("params")
        ).layout
    except Exception as exc:
        return [f"cost: no planner estimate ({str(exc).splitlines()[0][:160]})"]
    e = lay.epoch(tokens) if lay is not None else None
    if e is None:
        return []
    return [
        f"cost: the planner estimated {e['hours']:.2f} h, ${e['usd_spot']:,.2f} on spot or "
        f"${e['usd_on_demand']:,.2f} on demand, for these {tokens:,} tokens on "
        f"{lay.describe()} ({lay.tokens_per_s:,.0f} tokens/s: {lay.tokens_per_s_source})"
    ]


def read_job(run: Any) -> dict[str, Any] | None:
    """The job record its driver wrote (trainer.runtime.launch.JOB_RECORD), if any."""
    import json

    try:
        with run.fs.open_input_stream(run.join("job.json").path) as f:
            return json.loads(f.read().decode())
    except (OSError, ValueError):
        return None


def run_cost_lines(run: Any) -> list[str]:
    """cost_lines for a run's folder (a storage Location)."""
    from trainer.observability.metrics import lineage, read_records
    from trainer.resilience import journal

    steps, lost = lineage(read_records(run.join("metrics.jsonl")))
    faults = journal.summarize(journal.read(run))
    if faults["attempts"]:
        lost = sum(faults["lost_steps"])
    return run_lines(run, steps, lost)


def run_lines(run: Any, steps: list[dict[str, Any]], lost: int) -> list[str]:
    """What the run cost (its recorded nodes), then what the planner expected it to."""
    from tools.jobcli.devicemem import device_memory_lines
    from trainer.autoscaling.watch import read_nodes
    from trainer.observability.device_memory import read_final

    nodes = read_nodes(run)
    job = read_job(run)
    return (
        cost_lines(nodes, steps, lost)
        + planner_lines(job, nodes, steps)
        + device_memory_lines(job, nodes, steps, read_final(run))  # planned vs measured
    )


def submission_cost_lines(meta: dict[str, str]) -> list[str]:
    """run_cost_lines for a submission (its metadata names the run's storage); one line
    saying why when the storage is not readable from here."""
    from tools.jobcli.runs import submission_run

    try:
        run = submission_run(meta)
        if run is None:
            return []
        return run_cost_lines(run)
    except Exception as exc:  # a shared-FS path only the cluster mounts, no credentials, …
        return [f"cost: the run's records are not readable from here ({str(exc).splitlines()[0]})"]
