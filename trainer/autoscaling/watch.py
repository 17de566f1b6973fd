"""What the driver sees of the cluster while its job runs: the worker group's wait for nodes,
and the worker nodes the run had.

Only the head reaches Ray's GCS (a laptop reaches the Jobs API through a port forward), so
the driver, which runs there, watches and tells:

- **The wait.** While the job's worker group waits for its nodes (from a cluster at zero,
  the autoscaler launches them; on a restart, a replacement), a marked line in the job's log
  (``WAIT_MARK`` + JSON, printed when it changes and every ``REPEAT_S`` while waiting): per
  worker shape the nodes needed against the nodes up that fit one, and the autoscaler's
  launches by pool: pending, and failed with its reason (a spot pool that could not launch,
  after which v2 launches the on-demand pool). ``raylift run`` draws it as progress bars and
  ``raylift status`` shows the last one (tools/jobcli/waiting.py).
- **The nodes.** Every worker node up during the run, with its pool, market and instance
  type (Ray labels set by infra's boot script), first and last seen:
  ``<run>/nodes/<driver>.json``, which the run's cost is priced from (tools/jobcli/cost.py).

Pure functions (``demand``, ``snapshot``) take what Ray returns, so the rules are testable
without a cluster; ``ClusterWatch`` is the thread that feeds them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trainer.autoscaling.watch")

WAIT_MARK = "RAYLIFT_WAIT "
NODES_DIR = "nodes"
POLL_S = 5.0
REPEAT_S = 30.0
# Label keys: Ray sets ray.io/node-group from RAY_NODE_TYPE_NAME (the pool) and
# ray.io/market-type from RAY_NODE_MARKET_TYPE; infra's nodes also carry pool= and market=.
POOL_LABELS = ("ray.io/node-group", "pool")
MARKET_LABELS = ("ray.io/market-type", "market")
INSTANCE_TYPE_LABELS = ("instance-type", "ray.io/instance-type")
_HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class Shape:
    """One kind of worker bundle: its resources and the labels its node must carry."""

    resources: tuple[tuple[str, float], ...]
    labels: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        res = ", ".join(f"{k} {v:g}" for k, v in self.resources)
        lab = ", ".join(f"{k}={v}" for k, v in self.labels)
        return f"{res} on {lab}" if lab else res


def _shape(resources: Mapping[str, float], labels: Mapping[str, str] | None) -> Shape:
    return Shape(
        tuple(sorted((k, float(v)) for k, v in resources.items() if v)),
        tuple(sorted((labels or {}).items())),
    )


def demand(
    num_workers: int, per_worker: Mapping[str, float], selectors: list[dict[str, str]] | None
) -> dict[Shape, int]:
    """Workers needed per shape (rank 0's label selector makes its own shape)."""
    need: dict[Shape, int] = {}
    for rank in range(num_workers):
        labels = selectors[rank] if selectors and rank < len(selectors) else None
        s = _shape(per_worker, labels)
        need[s] = need.get(s, 0) + 1
    return need


def _label(labels: Mapping[str, str], keys: Iterable[str]) -> str | None:
    return next((labels[k] for k in keys if labels.get(k)), None)


def _is_head(node: Mapping[str, Any]) -> bool:
    return _HEAD_RESOURCE in (node.get("Resources") or {})


def fits_up(need: Mapping[Shape, int], nodes: Iterable[Mapping[str, Any]]) -> dict[Shape, int]:
    """How many workers of each shape the live nodes can hold (totals, not what is free:
    what the autoscaler has brought up). Shapes with labels are placed first, as Ray
    places a bundle with a selector only on a matching node."""
    free = [
        dict(n.get("Resources") or {}) | {"__labels__": n.get("Labels") or {}}
        for n in nodes
        if n.get("Alive")  # the head too: a local one may run workers; infra's has 0 CPUs
    ]
    up: dict[Shape, int] = {}
    for s in sorted(need, key=lambda s: not s.labels):
        up[s] = 0
        for node in free:
            labels = node["__labels__"]
            if any(labels.get(k) != v for k, v in s.labels):
                continue
            while up[s] < need[s] and all(node.get(k, 0) >= v for k, v in s.resources):
                for k, v in s.resources:
                    node[k] -= v
                up[s] += 1
    return up


def launches(status: Any, now: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The autoscaler's pending and failed launches by pool, from Ray's ClusterStatus
    (ray.autoscaler.v2.sdk.get_cluster_status); nodes launched but not yet running Ray count
    as pending."""
    pending: dict[str, dict[str, Any]] = {}
    for req in getattr(status, "pending_launches", []) or []:
        row = pending.setdefault(
            req.ray_node_type_name, {"pool": req.ray_node_type_name, "count": 0}
        )
        row["count"] += req.count
        row["since_s"] = round(max(0.0, now - req.request_ts_s))
    for node in getattr(status, "pending_nodes", []) or []:
        pool = node.ray_node_type_name
        row = pending.setdefault(pool, {"pool": pool, "count": 0})
        row["count"] += 1
        if node.details:
            row["status"] = node.details
    failed = [
        {
            "pool": req.ray_node_type_name,
            "count": req.count,
            "ago_s": round(max(0.0, now - (req.failed_ts_s or req.request_ts_s))),
            "why": (req.details or "launch failed").strip().splitlines()[0][:200],
        }
        for req in getattr(status, "failed_launches", []) or []
    ]
    for node in getattr(status, "failed_nodes", []) or []:
        failed.append(
            {
                "pool": node.ray_node_type_name,
                "count": 1,
                "why": (node.failure_detail or node.details or "node failed").splitlines()[0][:200],
            }
        )
    return sorted(pending.values(), key=lambda r: r["pool"]), failed


def worker_group_started(
    pgs: Mapping[str, Mapping[str, Any]], workers: tuple[int, int], per_worker: Mapping[str, float]
) -> bool | None:
    """True when a placement group of the worker group's shape is created, False while one
    is pending, None when none exists yet (Ray Train has not asked)."""
    want = {k: float(v) for k, v in per_worker.items() if v}
    found: bool | None = None
    for pg in pgs.values():
        bundles = list((pg.get("bundles") or {}).values())
        if not workers[0] <= len(bundles) <= workers[1]:
            continue
        if any({k: float(v) for k, v in b.items() if v} != want for b in bundles):
            continue
        if pg.get("state") == "CREATED":
            return True
        if pg.get("state") in ("PENDING", "RESCHEDULING", "PREPARED"):
            found = False
    return found


def snapshot(
    need: Mapping[Shape, int],
    nodes: list[Mapping[str, Any]],
    started: bool,
    status: Any = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The wait as one JSON-able record (what WAIT_MARK lines carry)."""
    now = time.time() if now is None else now
    up = fits_up(need, nodes)
    pending, failed = launches(status, now) if status is not None else ([], [])
    return {
        "started": started,
        "shapes": [
            {"shape": s.describe(), "need": n, "up": up.get(s, 0)}
            for s, n in sorted(need.items(), key=lambda kv: not kv[0].labels)
        ],
        "pending": pending,
        "failed": failed,
    }


def node_row(node: Mapping[str, Any]) -> dict[str, Any]:
    labels = node.get("Labels") or {}
    res = node.get("Resources") or {}
    return {
        "pool": _label(labels, POOL_LABELS),
        "market": _label(labels, MARKET_LABELS),
        "instance_type": _label(labels, INSTANCE_TYPE_LABELS),
        "gpus": res.get("GPU", 0),
        "cpus": res.get("CPU", 0),
    }


class ClusterWatch:
    """The driver's thread: wait lines while the worker group waits, node lifetimes always.

    Everything it does is best effort: a watch that fails logs at debug level and never
    stops the job."""

    def __init__(
        self,
        need: dict[Shape, int],
        workers: tuple[int, int],
        per_worker: Mapping[str, float],
        run: Any = None,
        source: str = "driver",
        poll_s: float = POLL_S,
        print_fn: Any = print,
    ) -> None:
        self.need, self.workers, self.per_worker = need, workers, dict(per_worker)
        self.run, self.source, self.poll_s = run, source, poll_s
        self.print = print_fn
        self.nodes: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[str, float] | None = None
        self._waiting_since: float | None = None
        self._written = 0.0

    def start(self) -> ClusterWatch:
        self._thread = threading.Thread(target=self._loop, name="raylift-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._write_nodes()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a watch never stops the job
                log.debug("cluster watch: %s", exc)
            self._stop.wait(self.poll_s)

    def _status(self) -> Any:
        try:
            import ray
            from ray.autoscaler.v2.sdk import get_cluster_status

            return get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
        except Exception as exc:  # no autoscaler v2 on this cluster
            log.debug("autoscaler status: %s", exc)
            return None

    def poll(self) -> dict[str, Any] | None:
        import ray
        from ray.util import placement_group_table

        now = time.time()
        nodes = ray.nodes()
        for n in nodes:
            # the head too where it runs workers (a local cluster's; infra's has 0 CPUs)
            runs_workers = any(n.get("Resources", {}).get(k, 0) > 0 for k in ("CPU", "GPU"))
            if n.get("Alive") and (runs_workers or not _is_head(n)):
                row = self.nodes.setdefault(n["NodeID"], {**node_row(n), "first": now})
                row["last"] = now
        if now - self._written > 60:
            self._write_nodes()
        started = worker_group_started(placement_group_table(), self.workers, self.per_worker)
        if started is None and self._waiting_since is None:
            return None  # Ray Train has not asked for its workers yet
        if started:
            if self._waiting_since is None:
                return None
            record = {**snapshot(self.need, nodes, True, now=now)}
            record["waited_s"] = round(now - self._waiting_since)
            self._waiting_since = None
            self._emit(record, now, force=True)
            return record
        if self._waiting_since is None:
            self._waiting_since = now
        record = snapshot(self.need, nodes, False, self._status(), now)
        record["waited_s"] = round(now - self._waiting_since)
        self._emit(record, now)
        return record

    def _emit(self, record: dict[str, Any], now: float, force: bool = False) -> None:
        # What changed, not how long: the same wait with a later clock is not news.
        key = json.dumps(
            {
                **record,
                "waited_s": None,
                "pending": [{**p, "since_s": None} for p in record["pending"]],
                "failed": [{**f, "ago_s": None} for f in record["failed"]],
            },
            sort_keys=True,
        )
        if force or self._last is None or self._last[0] != key or now - self._last[1] >= REPEAT_S:
            self._last = (key, now)
            self.print(WAIT_MARK + json.dumps(record, sort_keys=True), flush=True)

    def _write_nodes(self) -> None:
        if self.run is None or not self.nodes:
            return
        try:
            loc = self.run.join(NODES_DIR, f"{self.source}.json")
            self.run.fs.create_dir(self.run.join(NODES_DIR).path, recursive=True)
            with loc.fs.open_output_stream(loc.path) as f:
                f.write(json.dumps({"nodes": self.nodes}, sort_keys=True).encode())
            self._written = time.time()
        except Exception as exc:
            log.warning("nodes of the run not recorded (%s)", exc)


def read_nodes(run: Any) -> list[dict[str, Any]]:
    """Every worker node recorded for a run, by any of its drivers (one file per driver)."""
    import pyarrow.fs as pafs

    sel = pafs.FileSelector(run.join(NODES_DIR).path, allow_not_found=True)
    try:
        infos = run.fs.get_file_info(sel)
    except OSError:
        return []
    rows: list[dict[str, Any]] = []
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        try:
            with run.fs.open_input_stream(info.path) as f:
                data = json.loads(f.read().decode())
        except (OSError, ValueError):
            continue
        rows += [{"node_id": k, **v} for k, v in (data.get("nodes") or {}).items()]
    return rows
