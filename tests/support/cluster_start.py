"""Starting a local Ray cluster on a loaded machine: Ray gives a new node's raylet a fixed
30 s to register with the GCS (ray/_private/node.py, not configurable), and on a 2-core
machine running a second test suite beside it one start in a session missed it. The
session's cluster fixture is shared by every integration test of an xdist worker, so that
one miss failed 34 tests. A start that misses it is stopped whole (its session folder's
processes too) and made again, a fresh cluster each time; any other error is raised."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tools.localcluster import RAY_START_TIMEOUT

log = logging.getLogger(__name__)


def start_with_retries(
    make: Callable[[list[Any]], Any], stop: Callable[[Any], None], attempts: int = 3
) -> Any:
    """`make(built)` builds and starts a cluster, appending it to `built` as soon as it
    exists, and returns it; `stop(c)` ends a half-started one. Returns the first cluster
    that started; raises the last miss, or at once any other error."""
    for attempt in range(1, attempts + 1):
        built: list[Any] = []
        try:
            return make(built)
        except Exception as exc:
            for cluster in built:
                stop(cluster)
            if RAY_START_TIMEOUT not in str(exc) or attempt == attempts:
                raise
            log.warning("Ray cluster start %d/%d missed Ray's 30 s: again", attempt, attempts)
    raise AssertionError("attempts must be at least 1")
