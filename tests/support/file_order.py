"""The order `make test` hands files to its xdist workers: longest first.

Two workers take a file each at a time (`--dist loadfile`), and the run ends when the
second worker is done. xdist's own order sorts files by how many tests they hold, which
sends the many small unit files out first and the single long integration runs (a Ray job
of two minutes, one test) last: one worker then finishes such a run alone while the other
has nothing left. Longest first (`--no-loadscope-reorder` keeps this order) leaves only
short files for the end.

The seconds come from file_seconds.json: one run's worker-seconds per file, written by
`RAYLIFT_FILE_SECONDS_OUT=PATH make test` (tests/support/slowest_files.py). It orders and
nothing else, so a stale figure costs a little time, never a result. A file it does not
know yet is placed by where it lives (an integration file runs a cluster: about a minute).
test_images.py's figure is a cold image chain's (about 1,000 s in a fresh clone's CI): a
machine whose image store is warm from an earlier run builds it in a fraction of that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")
UNKNOWN_S = {"tests/integration/": 60.0, "tests/bench/": 10.0}
"""Seconds assumed for a file that file_seconds.json does not list, by folder."""
UNKNOWN_OTHER_S = 2.0
BEFORE = {"tests/integration/test_memory_tier.py": "tests/integration/test_autoscaling.py"}
"""A file that must be handed out after another: test_autoscaling runs its own Ray head,
and in a worker process where the RAM tier's tests had already connected to the token-auth
cluster with ray.init, its jobs met a GCS that asked for a token (seen in CI)."""


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}


def weight(rel: str, seconds: dict[str, float]) -> float:
    if rel in seconds:
        return seconds[rel]
    for folder, guess in UNKNOWN_S.items():
        if rel.startswith(folder):
            return guess
    return UNKNOWN_OTHER_S


def order(files: Iterable[str], seconds: dict[str, float]) -> list[str]:
    """`files` (paths relative to the repository) longest first; ties keep their order.
    A file named in BEFORE comes right after the one it must follow, if it would not."""
    ranked = sorted(dict.fromkeys(files), key=lambda f: -weight(f, seconds))
    for later, first in BEFORE.items():
        if later in ranked and first in ranked and ranked.index(later) < ranked.index(first):
            ranked.remove(later)
            ranked.insert(ranked.index(first) + 1, later)
    return ranked
