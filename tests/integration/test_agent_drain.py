"""The node agent on a real Ray cluster: a spot notice from the fake metadata service drains
exactly the agent's own node, for preemption, with the notice's deadline less the margin;
once the node's work has left, the agent completes infra's drain hook (a fake Auto Scaling
API on 127.0.0.1), and the GCS records the drain's reason when the node goes.

The agent's nodes are added to the session's cluster for this module (1-CPU nodes whose
cloud instance ids are the fake instances', as the image's entrypoint sets them); a drain
cannot be undone, so only those nodes are ever drained. (That Ray Train reports such
a drain through `ray.train.get_preemption_info()` is measured by tests/bench, with latency.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.imds import SPOT_PATH, TOKEN_PATH, FakeAutoScaling, FakeImds

pytestmark = pytest.mark.slow

INSTANCE_ID = "i-0agent0test00001"
MARGIN_S = 15
# infra's /etc/raylift/node.env on a spot worker, as the container's environment.
NODE_ENV = {
    "RAYLIFT_ROLE": "worker",
    "RAYLIFT_MARKET": "spot",
    "RAYLIFT_REGION": "us-east-1",
    "RAYLIFT_INSTANCE_ID": INSTANCE_ID,
    "RAYLIFT_ASG_NAME": "demo-gpu-spot",
    "RAYLIFT_LIFECYCLE_HOOK": "raylift-drain",
}


def wait_for(what: str, check: Callable[[], object], timeout: float = 300) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not after {timeout:.0f}s")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The session's cluster plus one node for the agent, with the fake instance's cloud
    instance id (as the image's entrypoint sets it) and a resource of its own that only
    this module's work asks for. (A second cluster cannot start in this process: Ray keeps
    one auth token per process.) A drained idle node shuts itself down; the nodes the
    training tests use carry labels this one does not."""
    # The raylet takes its cloud instance id from the environment it starts in.
    os.environ["RAY_CLOUD_INSTANCE_ID"] = INSTANCE_ID
    try:
        worker = ray_cluster.add_node(num_cpus=1, resources={"agent_test": 1})
    finally:
        os.environ.pop("RAY_CLOUD_INSTANCE_ID")
    yield ray_cluster, worker


def gcs(c):
    from ray._raylet import GcsClient

    return GcsClient(address=c.address)


# Work on the worker node, as a training worker would be: an actor holding its only CPU, owned
# by a driver in its own process (a driver inside pytest would read Ray's address settings
# before the local cluster sets them), alive until its stdin closes.
HOLDER = r"""
import sys, ray
ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
@ray.remote(num_cpus=1, resources={"agent_test": 1})
class Busy:
    def node(self):
        return ray.get_runtime_context().get_node_id()
busy = Busy.remote()
print("holder on", ray.get(busy.node.remote()), flush=True)
sys.stdin.read()
"""


def start_agent(imds: FakeImds, asg: FakeAutoScaling, address: str, log: Path, **env: str):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer",
            "agent",
            f"--imds-endpoint={imds.endpoint}",
            "--interval=0.2",
            f"--margin={MARGIN_S}",
            f"--gcs-address={address}",
        ],
        env={
            **os.environ,
            **NODE_ENV,
            "AWS_ENDPOINT_URL_AUTO_SCALING": asg.endpoint,
            "AWS_ACCESS_KEY_ID": "fake",
            "AWS_SECRET_ACCESS_KEY": "fake",
            **env,
        },
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def death_of(c, node_id: str):
    """The GCS's record of why a node went, once it has gone."""
    from ray.core.generated import gcs_pb2

    def dead():
        for node in gcs(c).get_all_node_info(timeout=10).values():
            if node.node_id.hex() == node_id and node.state == gcs_pb2.GcsNodeInfo.DEAD:
                return node
        return None

    death = wait_for(f"node {node_id} gone", dead).death_info
    return death.Reason.Name(death.reason), death.reason_message


def test_spot_notice_drains_the_agents_own_node_with_the_notice_deadline(cluster, tmp_path):
    c, worker = cluster
    worker_id = worker.node_id
    agent_log = tmp_path / "agent.log"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, c.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Ray prints its own news to a driver's stdout too (a loaded CI saw "(raylet) The
        # node ... has been marked dead" come first): read up to the holder's line.
        line = ""
        while not line.startswith("holder on "):
            line = holder.stdout.readline()
            assert line, "the holder exited before reporting its node"
        assert line.split()[-1] == worker_id, line
        with FakeImds(instance_id=INSTANCE_ID) as imds, FakeAutoScaling() as asg:
            agent = start_agent(imds, asg, c.address, agent_log)
            try:
                log = agent_log.read_text
                # Before any notice: the agent polls (with a session token), drains nothing.
                wait_for("three polls", lambda: len(imds.requests_to(SPOT_PATH)) >= 3)
                assert imds.requests[0].method == "PUT" and imds.requests[0].path == TOKEN_PATH
                # The metadata service goes away for a while: the agent outlives it.
                with imds.down():
                    wait_for("the outage logged", lambda: "unreachable" in log())
                    assert agent.poll() is None
                wait_for("polls again", lambda: "answers again" in log())
                # A rebalance recommendation is logged, and drains nothing.
                imds.trigger_rebalance()
                wait_for("rebalance logged", lambda: "rebalance recommendation" in log())
                assert gcs(c).get_draining_nodes() == {}

                notice = imds.trigger_spot(120)
                draining = wait_for("a drain", lambda: gcs(c).get_draining_nodes())
                wait_for("the drain logged", lambda: "drained Ray node" in log())
                # The hook is completed only once the work has left the node. (Asserting that
                # nothing happens has nothing to wait on: give the agent a second to be wrong.)
                wait_for("the agent waiting", lambda: "completing once" in log())
                time.sleep(1)
                released = time.time()
                holder.stdin.close()  # the driver ends, and its actor with it
                wait_for("the lifecycle action", lambda: asg.calls)
                polls = len(imds.requests_to(SPOT_PATH))
                wait_for("more polls", lambda: len(imds.requests_to(SPOT_PATH)) >= polls + 3)
            finally:
                agent.terminate()
                rc = agent.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait()
    text = agent_log.read_text()
    assert rc == 0, text
    # Exactly its own node, once, with the notice's time less the margin.
    assert list(draining) == [worker_id], text
    expected_ms = (notice.timestamp() - MARGIN_S) * 1000
    assert abs(draining[worker_id] - expected_ms) < 1500, (draining, expected_ms)
    assert text.count("spot notice: terminate") == 1, text
    assert text.count("drained Ray node") == 1, text
    gets = [r for r in imds.requests if r.method == "GET"]
    assert all(r.token for r in gets) and not [r for r in gets if r.status == 401]
    ((called_at, form),) = asg.calls
    assert called_at > released, "the hook was completed while work still ran on the node"
    assert form == {
        "Action": "CompleteLifecycleAction",
        "Version": "2011-01-01",
        "LifecycleHookName": "raylift-drain",
        "AutoScalingGroupName": "demo-gpu-spot",
        "InstanceId": INSTANCE_ID,
        "LifecycleActionResult": "CONTINUE",
    }
    # A drained node leaves once idle; the GCS records the drain's reason and message.
    assert death_of(c, worker_id) == (
        "AUTOSCALER_DRAIN_PREEMPTED",
        f"EC2 spot interruption notice: terminate at {notice:%Y-%m-%dT%H:%M:%SZ}",
    )


def test_auto_scaling_termination_drains_and_completes_the_drain_hook(cluster, tmp_path: Path):
    """A termination the group starts itself (scale-in, health replacement): the instance
    waits on infra's drain hook; the agent drains its node, and as nothing runs there, the
    node leaves and the agent completes the lifecycle action at once."""
    c, _ = cluster
    instance_id = "i-0agent0test00002"
    os.environ["RAY_CLOUD_INSTANCE_ID"] = instance_id
    try:
        node = c.add_node(num_cpus=1, resources={"agent_test": 1})
    finally:
        os.environ.pop("RAY_CLOUD_INSTANCE_ID")
    agent_log = tmp_path / "agent.log"
    with FakeImds(instance_id=instance_id) as imds, FakeAutoScaling() as asg:
        agent = start_agent(imds, asg, c.address, agent_log, RAYLIFT_INSTANCE_ID=instance_id)
        try:
            wait_for("three polls", lambda: len(imds.requests_to(SPOT_PATH)) >= 3)
            imds.trigger_termination()
            wait_for("the lifecycle action", lambda: asg.calls)
        finally:
            agent.terminate()
            rc = agent.wait(timeout=30)
    text = agent_log.read_text()
    assert rc == 0, text
    ((_, form),) = asg.calls
    assert (form["InstanceId"], form["LifecycleActionResult"]) == (instance_id, "CONTINUE")
    assert text.count("Auto Scaling is terminating this instance") == 1, text
    assert death_of(c, node.node_id) == (
        "AUTOSCALER_DRAIN_PREEMPTED",
        "Auto Scaling termination (lifecycle hook raylift-drain)",
    )
