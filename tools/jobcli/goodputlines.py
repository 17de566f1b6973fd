"""Goodput lines for `raylift report`, `status` and the demo (trainer.observability.goodput
on a run's folder), priced where the run recorded its nodes' instance types."""

from __future__ import annotations

from typing import Any

from trainer.observability import goodput


def run_bill(run: Any) -> float | None:
    """The run's dollars, where every recorded node is priced by the catalog; else None
    (a local cluster, or nodes from before the driver recorded them)."""
    from tools.jobcli.cost import price_nodes
    from trainer.autoscaling.watch import read_nodes

    nodes = read_nodes(run)
    if not nodes or not any(n.get("instance_type") for n in nodes):
        return None
    pools, _ = price_nodes(nodes)
    if not pools or any(p.usd is None for p in pools.values()):
        return None
    return sum(float(p.usd or 0.0) for p in pools.values())


def measure_run(
    run: Any, records: list[dict[str, Any]], journal_records: list[dict[str, Any]]
) -> goodput.Goodput:
    return goodput.measure(records, journal_records, usd_total=run_bill(run))


def run_goodput_lines(run: Any) -> list[str]:
    """The split of a run's folder (a storage Location) as lines."""
    from trainer.observability.metrics import read_records
    from trainer.resilience import journal

    g = measure_run(run, read_records(run.join("metrics.jsonl")), journal.read(run))
    return goodput.lines(g)


def submission_goodput_lines(meta: dict[str, str]) -> list[str]:
    """run_goodput_lines for a submission (its metadata names the run's storage); nothing
    when its storage is not readable from here (the cost line already says why)."""
    from tools.jobcli.runs import submission_run

    try:
        run = submission_run(meta)
        if run is None:
            return []
        return run_goodput_lines(run)
    except Exception:  # a shared-FS path only the cluster mounts, no credentials, …
        return []
