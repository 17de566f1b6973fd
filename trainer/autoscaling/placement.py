"""Where rank 0 goes on a cluster that may be at zero: a label the autoscaler can satisfy.

With pools idle at zero, no `large_cpu_mem` node is up when a job is submitted; dropping
rank 0's label then (as a fixed cluster could) would put rank 0 on a small node. So the
label stays a requirement whenever a live node has it *or* the autoscaler can launch one:
the placement group then asks for it, and Ray's autoscaler v2 launches that pool.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

# Set on the head by infra (infra/autoscaler.py): the autoscaling config Ray's monitor reads.
CONFIG_ENV = "RAYLIFT_AUTOSCALER_CONFIG"


def launchable_labels(path: str | os.PathLike[str] | None = None) -> list[dict[str, str]]:
    """Labels of the node types the autoscaler may launch (none on a fixed cluster)."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path or not Path(path).is_file():
        return []
    config = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return [
        dict(t.get("labels") or {})
        for t in (config.get("available_node_types") or {}).values()
        if t.get("max_workers", 0) > 0
    ]


def _has(labels: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in want.items())


def rank0_selector(
    want: Mapping[str, str] | None,
    num_workers: int,
    live: Iterable[Mapping[str, str]],
    launchable: Iterable[Mapping[str, str]],
) -> list[dict[str, str]] | None:
    """Per-worker label selectors (rank 0 first), or None where no node can ever have them
    (a local or small cluster still runs, rank 0 placed freely)."""
    if not want:
        return None
    if any(_has(n, want) for n in live) or any(_has(n, want) for n in launchable):
        return [dict(want)] + [{} for _ in range(num_workers - 1)]
    return None
