"""The cluster's past runs as evidence for the cadence's failure rates (issue 49).

The cadence starts from a prior (the pool's spot band, a hardware rate per GPU-hour:
`trainer.planner.cadence.prior_rates`) that its own journal then moves. A new run on a
pool that lost a node a day in each of its last ten runs should not start from the
catalog's guess, so the journals of the other runs under the same `storage.path` count
too, for the same pool only: instance type and market (a spot pool and an on-demand pool
of one type fail very differently).

Each attempt journals its pool at its start (`pool_record`: instance type and market of
rank 0's node, nodes, GPUs per node). From a past run's journal, every attempt gives its
node-hours (its nodes × the time from its start to its last record before the next
attempt) and the faults that ended it (the controller's failure causes; a restart with no
failure record is a driver lost). Pooling is Poisson per node: a failure rate of the job
is nodes × λ_node, so a past run's node-hours count as node_hours / nodes hours of this
job, its faults as they are, and `cadence.observed_rates` takes the sum with the run's
own. Attempts with no pool record (journals older than this) or a drill's stated rate
(`checkpoint.failure_rate_per_hour`) are not evidence.

Reading is bounded: the `MAX_RUNS` newest runs (by their newest journal file), within
`BUDGET_S` seconds; a run whose journal cannot be listed or read is skipped, never an
error. Three ways to list the same layout: pyarrow (the run's driver, once for every
rank: `trainer.checkpoint.past_runs`), the standard library and boto3 (the laptop's
`raylift plan`: `read_storage`, the way `trainer.planner.history` lists runs; pyarrow is
not installed there).

Pure Python: no torch, Ray, numpy or pyarrow, at import or later.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from trainer.planner.cadence import (
    INSTANCE_TYPE_LABELS,
    MARKET_LABELS,
    PRIOR_HOURS,
    RAM,
    STORAGE,
    Rates,
    observed_rates,
    tier_of,
)

MAX_RUNS = 50
"""Past runs read at most (the newest)."""
BUDGET_S = 10.0
"""Seconds the listing and reading may take; what is not read by then is not evidence."""
JOURNAL_DIR = "journal"  # trainer.resilience.journal.JOURNAL_DIR (that module needs pyarrow)


# ---------------------------------------------------------------- the pool


def pool_key(instance_type: str, market: str) -> str:
    return f"{instance_type or 'unknown'}/{market}"


def pool_record(
    labels: dict[str, str], world_size: int, drill_rate: float | None = None
) -> dict[str, Any]:
    """What an attempt journals of its pool: rank 0's node's instance type and market
    (the labels `cadence.spot_band_of` reads), the nodes and GPUs per node the cadence
    sizes its priors by, and a drill's stated rate when the job sets one."""
    from trainer.planner.catalog import load_instances

    itype = next((labels[k] for k in INSTANCE_TYPE_LABELS if labels.get(k)), "")
    market = next((labels[k] for k in MARKET_LABELS if labels.get(k)), "")
    spec = load_instances().get(itype)
    per_node = max(1, spec.gpu_count) if spec is not None else 1
    record: dict[str, Any] = {
        "instance_type": itype,
        "market": "spot" if market.lower() == "spot" else "on-demand",
        "nodes": math.ceil(max(1, world_size) / per_node),
        "gpus_per_node": per_node,
    }
    if drill_rate is not None:
        record["drill_rate_per_hour"] = drill_rate
    return record


# ---------------------------------------------------------------- the evidence


@dataclass
class PastFaults:
    """What past runs on one pool saw: how many runs, their node-hours, faults by cause."""

    runs: int = 0
    node_hours: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)

    def tiers(self) -> dict[str, int]:
        """Faults per tier (drained notices and errors count for neither)."""
        out = {RAM: 0, STORAGE: 0}
        for cause, n in self.faults.items():
            tier = tier_of(cause)
            if tier is not None:
                out[tier] += n
        return out

    def job_hours(self, nodes: int) -> float:
        """The past node-hours as hours of a job of `nodes` nodes (rate_job = nodes × λ)."""
        return self.node_hours / max(1, nodes)

    def record(self, nodes: int) -> dict[str, Any]:
        """What the run journals with its first cadence decision."""
        return {
            "past_runs": self.runs,
            "past_node_hours": round(self.node_hours, 3),
            "past_job_hours": round(self.job_hours(nodes), 3),
            "past_faults": self.tiers(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "node_hours": self.node_hours, "faults": dict(self.faults)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PastFaults:
        return cls(int(d["runs"]), float(d["node_hours"]), {**d.get("faults", {})})


@dataclass
class Reading:
    """The past runs under a storage path, by pool (`pool_key`)."""

    pools: dict[str, PastFaults] = field(default_factory=dict)
    read: int = 0
    skipped: list[str] = field(default_factory=list)
    """Runs whose journal could not be listed or read."""
    note: str | None = None
    """Why fewer runs than there are were read (the time budget), or why none were."""

    def for_pool(self, instance_type: str, market: str) -> PastFaults:
        return self.pools.get(pool_key(instance_type, market), PastFaults())

    def to_dict(self) -> dict[str, Any]:
        return {
            "pools": {k: v.to_dict() for k, v in self.pools.items()},
            "read": self.read,
            "skipped": list(self.skipped),
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Reading:
        if not d:
            return cls()
        pools = {k: PastFaults.from_dict(v) for k, v in d.get("pools", {}).items()}
        return cls(pools, int(d.get("read", 0)), list(d.get("skipped", [])), d.get("note"))


def attempts(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, dict[str, int]]]:
    """(pool record, node-hours, faults by cause) per attempt of one run's journal that
    journaled its pool. An attempt trains from its record to its last record before the
    next attempt (a new driver's record excluded: a resubmission may come days later);
    the failures in that window ended it, and a restart after it with none is a driver
    lost."""
    recs = sorted((r for r in records if "time" in r), key=lambda r: float(r["time"]))
    starts = [r for r in recs if r.get("event") == "attempt"]
    out = []
    for i, start in enumerate(starts):
        t0 = float(start["time"])
        t1 = float(starts[i + 1]["time"]) if i + 1 < len(starts) else math.inf
        window = [
            r
            for r in recs
            if t0 <= float(r["time"]) < t1 and r.get("event") not in ("attempt", "driver")
        ]
        end = max((float(r["time"]) for r in window), default=t0)
        faults: dict[str, int] = {}
        for r in window:
            if r.get("event") == "failure":
                cause = str(r.get("cause"))
                faults[cause] = faults.get(cause, 0) + 1
        if i + 1 < len(starts) and starts[i + 1].get("after") == "failure" and not faults:
            faults["driver_lost"] = 1
        pool = start.get("pool")
        if not isinstance(pool, dict) or pool.get("drill_rate_per_hour") is not None:
            continue  # no pool journaled (an older run), or a drill's stated rate
        nodes = max(1, int(pool.get("nodes") or 1))
        out.append((pool, nodes * (end - t0) / 3600.0, faults))
    return out


def summarize(runs: Iterable[tuple[str, list[dict[str, Any]] | None]]) -> Reading:
    """The evidence by pool from (run name, its journal records; None: unreadable)."""
    reading = Reading()
    for name, records in runs:
        if records is None:
            reading.skipped.append(name)
            continue
        try:
            found = attempts(records)
        except (TypeError, ValueError, AttributeError):  # records of another shape
            reading.skipped.append(name)
            continue
        reading.read += 1
        seen: set[str] = set()
        for pool, node_hours, faults in found:
            key = pool_key(str(pool.get("instance_type") or ""), str(pool.get("market")))
            past = reading.pools.setdefault(key, PastFaults())
            if key not in seen:
                past.runs += 1
                seen.add(key)
            past.node_hours += node_hours
            for cause, n in faults.items():
                past.faults[cause] = past.faults.get(cause, 0) + n
    return reading


def pooled_rates(
    prior: Rates,
    own_faults: dict[str, int],
    own_hours: float,
    past: PastFaults,
    nodes: int,
) -> Rates:
    """The prior moved by the run's own faults and the past runs' on its pool together:
    per tier (prior·PRIOR_HOURS + own + past faults) / (PRIOR_HOURS + own hours + past
    node-hours / nodes). What `cadence.for_run` computes when handed the past."""
    counts = dict(own_faults)
    for cause, n in past.faults.items():
        counts[cause] = counts.get(cause, 0) + n
    return observed_rates(prior, counts, own_hours + past.job_hours(nodes))


def plan_rates(
    prior: Rates,
    reading: Reading,
    instance: str,
    market: str,
    nodes: int,
    band: str | None,
    stated: float | None = None,
) -> tuple[Rates, str]:
    """The rates `raylift plan` simulates with (the prior moved by the past runs on the
    plan's pool, as a run's first attempt starts from), and one line: which, from what."""
    head = f"failure rates ({nodes} × {instance} {market})"
    if stated is not None:
        line = (
            f"{head}: {prior.memory:.3g}/h the RAM tier covers, {prior.storage:.3g}/h only "
            f"storage covers: checkpoint.failure_rate_per_hour ({stated:g}/h) as stated; past "
            "runs not counted"
        )
        return prior, line
    past = reading.for_pool(instance, market)
    rates = pooled_rates(prior, {}, 0.0, past, nodes)
    tiers = past.tiers()
    prior_what = f"spot band {band}" if band else "on demand"
    moved = (
        f"and {past.runs} past run(s) on that pool under storage.path ({past.node_hours:,.1f} "
        f"node-hours; {tiers[RAM]} RAM-tier and {tiers[STORAGE]} storage faults)"
        if past.runs
        else "alone" + ("" if reading.note else " (no past run on that pool under storage.path)")
    )
    line = (
        f"{head}: {rates.memory:.3g}/h the RAM tier covers, {rates.storage:.3g}/h only "
        f"storage covers: the prior ({prior_what}, hardware, weighted as {PRIOR_HOURS:g} h) {moved}"
    )
    if reading.skipped:
        line += f"; {len(reading.skipped)} unreadable run(s) skipped"
    if reading.note:
        line += f"; {reading.note}"
    return rates, line


# ---------------------------------------------------------------- reading storage


class _Store(Protocol):
    def folders(self) -> list[str]: ...

    def journal_files(self, folder: str) -> list[tuple[str, float]]: ...

    def text(self, file: str) -> str: ...


def _parse(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed writer
        if isinstance(record, dict):
            out.append(record)
    return out


def collect(
    store: _Store,
    exclude: str | None,
    max_runs: int = MAX_RUNS,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
) -> Reading:
    """The newest `max_runs` runs' evidence (by their newest journal file), `exclude`
    (the run itself: its own journal counts already) left out, within `budget_s`."""
    deadline = clock() + budget_s
    listed: list[tuple[float, str, list[str]]] = []
    skipped: list[str] = []
    folders = [f for f in store.folders() if f != exclude and not f.startswith(("_", "."))]
    note = None
    for folder in folders:
        if clock() > deadline:
            note = f"time budget ({budget_s:g} s) spent after listing {len(listed)} runs"
            break
        try:
            files = store.journal_files(folder)
        except Exception:  # a run folder that cannot be listed: not evidence
            skipped.append(folder)
            continue
        if files:
            listed.append((max(m for _, m in files), folder, [f for f, _ in files]))
    listed.sort(reverse=True)
    runs: list[tuple[str, list[dict[str, Any]] | None]] = []
    for _, folder, files in listed[:max_runs]:
        if clock() > deadline:
            note = f"time budget ({budget_s:g} s) spent after reading {len(runs)} runs"
            break
        try:
            runs.append((folder, [r for f in files for r in _parse(store.text(f))]))
        except Exception:  # unreadable (torn, not text, gone): skipped, never an error
            runs.append((folder, None))
    reading = summarize(runs)
    reading.skipped = skipped + reading.skipped
    reading.note = note
    return reading


def stamp(t: Any) -> float:
    return t.timestamp() if isinstance(t, datetime) else float(t or 0.0)


class _LocalStore:
    """The laptop's local or shared-FS storage path, with the standard library."""

    def __init__(self, root: str):
        self.root = Path(root).expanduser()

    def folders(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def journal_files(self, folder: str) -> list[tuple[str, float]]:
        d = self.root / folder / JOURNAL_DIR
        if not d.is_dir():
            return []
        return [(str(p), p.stat().st_mtime) for p in d.glob("*.jsonl") if p.is_file()]

    def text(self, file: str) -> str:
        return Path(file).read_bytes().decode()


class _BotoStore:
    """The laptop's s3:// storage path, with boto3: the planner's reader of the runs under
    a storage path (trainer.planner.runstore.S3Runs), through its public listing."""

    def __init__(self, uri: str, endpoint: str | None, region: str | None):
        from trainer.planner.runstore import S3Runs

        self.s3 = S3Runs(uri, endpoint, region)  # Unreadable when boto3 is missing

    def folders(self) -> list[str]:
        return sorted(self.s3.folders())

    def journal_files(self, folder: str) -> list[tuple[str, float]]:
        objs = self.s3.objects(f"{folder}/{JOURNAL_DIR}/")
        return [(rel, stamp(modified)) for rel, modified in objs if rel.endswith(".jsonl")]

    def text(self, file: str) -> str:
        text = self.s3.text(file)
        if text is None:  # gone between the listing and the read: the run is skipped
            raise FileNotFoundError(f"{self.s3.uri}/{file}")
        return text


def read_storage(
    uri: str | None,
    endpoint: str | None = None,
    region: str | None = None,
    exclude: str | None = None,
    **kw: Any,
) -> Reading:
    """The past runs under a job's storage.path, for the laptop (`raylift plan`): a local
    path with the standard library, s3:// with boto3. Storage that cannot be listed gives
    a Reading whose note says so in one line."""
    from trainer.planner.runstore import Unreadable

    if not uri or ("://" in uri and not uri.startswith("s3://")):
        return Reading(note=f"{uri}: past runs not read (not a local or s3:// path)")
    try:
        store: _Store = (
            _BotoStore(uri, endpoint, region) if uri.startswith("s3://") else _LocalStore(uri)
        )
        return collect(store, exclude, **kw)
    except Unreadable as exc:
        return Reading(note=str(exc))
    except Exception as exc:  # botocore's errors, a folder not listable: one line
        return Reading(note=f"{uri}: past runs not read: {short(exc)}")


def short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
