"""A start that misses Ray's fixed 30 s is ended whole and made again; any other error, or the
last miss, is raised at once: a whole cluster (tests/support/cluster_start.py) and one node
added to it (tools/localcluster.py, LocalCluster.add_node)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.cluster_start import start_with_retries
from tools.localcluster import LocalCluster

MISS = Exception("The current node timed out during startup. This could happen ...")


def _maker(errors: list[Exception | None]):
    made, stopped = [], []

    def make(built: list) -> str:
        name = f"cluster{len(made)}"
        made.append(name)
        built.append(name)
        err = errors[len(made) - 1]
        if err is not None:
            raise err
        return name

    return make, made, stopped


def test_a_missed_start_is_stopped_and_made_again() -> None:
    make, made, stopped = _maker([MISS, None])
    assert start_with_retries(make, stopped.append) == "cluster1"
    assert made == ["cluster0", "cluster1"] and stopped == ["cluster0"]


def test_another_error_or_the_last_miss_is_raised() -> None:
    make, made, stopped = _maker([ValueError("bad port"), None])
    with pytest.raises(ValueError, match="bad port"):
        start_with_retries(make, stopped.append)
    assert made == ["cluster0"] and stopped == ["cluster0"]
    make, made, stopped = _maker([MISS, MISS, MISS])
    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retries(make, stopped.append, attempts=3)
    assert stopped == made == ["cluster0", "cluster1", "cluster2"]


class _Nodes:
    """Stands in for ray.cluster_utils.Cluster's add_node only: Ray's 30 s miss cannot be
    forced on demand. Each start runs a real process with the raylet's environment (the
    mark included), then raises what that start is given."""

    def __init__(self, errors: list[Exception | None]) -> None:
        self.errors, self.procs = errors, []

    def add_node(self, **kwargs):
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            env={**os.environ, **kwargs["env_vars"]},
        )
        self.procs.append(proc)
        err = self.errors[len(self.procs) - 1]
        if err is not None:
            raise err
        return f"node{len(self.procs)}"


def _cluster(errors: list[Exception | None]) -> tuple[LocalCluster, _Nodes]:
    cluster, nodes = LocalCluster(), _Nodes(errors)
    cluster._cluster = nodes
    return cluster, nodes


def test_a_node_that_misses_its_start_is_ended_and_started_again() -> None:
    cluster, nodes = _cluster([MISS, None])
    try:
        node = cluster.add_node(labels={"pool": "cpu"}, env={"A": "1"})
        assert node == "node2" and cluster.worker_nodes == [("node2", {"pool": "cpu"})]
        assert nodes.procs[0].wait(timeout=30) == -signal.SIGKILL  # the missed start's
        assert nodes.procs[1].poll() is None  # the started node's processes live on
    finally:
        for p in nodes.procs:
            p.kill()
            p.wait()


def test_a_node_start_fails_at_once_on_another_error_and_after_the_last_miss() -> None:
    other = RuntimeError("port taken")
    for errors, raised, starts in (([other], other, 1), ([MISS, MISS, MISS], MISS, 3)):
        cluster, nodes = _cluster(errors)
        try:
            with pytest.raises(type(raised)) as info:
                cluster.add_node()
            assert info.value is raised and len(nodes.procs) == starts
            assert cluster.worker_nodes == []
        finally:
            for p in nodes.procs:
                p.kill()
                p.wait()
