"""tools/localcluster.py: a second local cluster started in the same process works. Ray's
C++ side keeps the auth token it read first, so a start made again after a miss (the
session fixture's retry, tests/support/cluster_start.py) met its own new GCS with the old
token and failed with InvalidAuthToken (seen at load 20-50, in 6 of 11 fixture starts).
Run in a fresh process, as an xdist worker's first cluster is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import ROOT

pytestmark = pytest.mark.slow

SCRIPT = """
from tests.support.cluster_start import start_with_retries
from tools.localcluster import LocalCluster

tokens = []

def make(built):
    cluster = LocalCluster(num_cpus=0)
    built.append(cluster)
    cluster.start()
    cluster.add_node(num_cpus=1)  # its raylet registers through this process's GCS client
    cluster.wait_nodes(2)
    tokens.append(cluster.token)
    if len(tokens) == 1:  # the first start counts as a miss: made again, a new token
        raise Exception("The current node timed out during startup (made up)")
    return cluster

cluster = start_with_retries(make, lambda c: c.stop())
try:
    assert len(tokens) == 2 and tokens[0] != tokens[1], tokens
    print("second cluster up", flush=True)
finally:
    cluster.stop()
"""


def test_a_cluster_made_again_in_the_same_process_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0 and "second cluster up" in done.stdout, done.stderr[-3000:]
