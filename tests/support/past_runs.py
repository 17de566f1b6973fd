"""Past runs' journals, written by the real Journal under a storage root (local or S3),
for the tests of the cadence's rates from the cluster's past runs (issue 49)."""

from __future__ import annotations

import time

from trainer.planner import fault_history
from trainer.resilience.journal import Journal
from trainer.storage.location import Location

SPOT = {"ray.io/market-type": "spot", "instance-type": "g5.12xlarge"}  # 4 GPUs a node
ON_DEMAND = {"instance-type": "g5.12xlarge"}
T = time.time() - 10 * 86400  # long enough ago that no fault of it is a burst now
H = 3600.0


def _journal(root: Location, run: str, source: str) -> Journal:
    return Journal(root.join(run), source)


def attempt(j: Journal, at: float, n: int, pool: dict | None, after: str = "start") -> None:
    j.add("attempt", time=at, attempt=n, after=after, from_step=0, pool=pool)


def write_past_runs(root: Location) -> None:
    """Two past runs on the new run's pool with faults, one on the on-demand pool of the
    same type, a drill, a journal from before pools were journaled, two unreadable ones. On
    the SPOT pool that is 2 runs, 16 node-hours, 2 RAM-tier faults (a worker died, a node
    lost) and 1 storage fault (a driver lost); a drained notice counts for neither."""
    two, four = (fault_history.pool_record(SPOT, w) for w in (8, 16))
    assert (two["nodes"], two["gpus_per_node"], two["market"]) == (2, 4, "spot")
    # past-a, 2 nodes: trained 2 h until a worker died, then 1 h to the end: 6 node-hours
    a1 = _journal(root, "past-a", "attempt-1-rank0")
    attempt(a1, T, 1, two)
    a1.add("checkpoint", time=T + H, step=100, kind="periodic")
    _journal(root, "past-a", "controller-1").add("failure", time=T + 2 * H, cause="worker_died")
    a2 = _journal(root, "past-a", "attempt-2-rank0")
    attempt(a2, T + 2.1 * H, 2, two, "failure")
    a2.add("finished", time=T + 3.1 * H)
    # past-b, 4 nodes: a node lost after 1 h (4 node-h); 0.5 h, then its driver lost (no
    # failure record before the next attempt; the new driver's record is not training:
    # 2 node-h); 0.5 h until a drained notice (counts for neither tier: 2 node-h); 0.5 h
    # to the end (2 node-h): 10 node-hours
    ctl = _journal(root, "past-b", "controller-1")
    b1 = _journal(root, "past-b", "attempt-1-rank0")
    attempt(b1, T, 1, four)
    ctl.add("failure", time=T + H, cause="node_lost")
    b2 = _journal(root, "past-b", "attempt-2-rank0")
    attempt(b2, T + 1.2 * H, 2, four, "failure")
    b2.add("checkpoint", time=T + 1.7 * H, step=50, kind="periodic")
    _journal(root, "past-b", "driver-2").add("driver", time=T + 2.9 * H, resubmit=True)
    b3 = _journal(root, "past-b", "attempt-3-rank0")
    attempt(b3, T + 3 * H, 3, four, "failure")
    ctl.add("failure", time=T + 3.5 * H, cause="preempted")
    b4 = _journal(root, "past-b", "attempt-4-rank0")
    attempt(b4, T + 3.6 * H, 4, four, "failure")
    b4.add("finished", time=T + 4.1 * H)

    def faulty(run: str, pool: dict | None, kills: int = 3) -> None:
        j = _journal(root, run, "attempt-1-rank0")
        attempt(j, T, 1, pool)
        for i in range(kills):
            _journal(root, run, f"controller-{i}").add(
                "failure", time=T + (i + 1) * 60, cause="worker_died"
            )

    faulty("other-pool", fault_history.pool_record(ON_DEMAND, 8))
    faulty("drill", fault_history.pool_record(SPOT, 8, drill_rate=120.0))
    faulty("old", None)
    faulty("broken", two)
    with root.fs.open_output_stream(root.join("broken", "journal", "controller-9.jsonl").path) as f:
        f.write(b"\xff\xfe\x00 not text")
    faulty("garbled", {**two, "nodes": "many"})  # read, but not a record this reads
