"""The node provider against moto's AWS server on 127.0.0.1 (boto3's wire protocol)."""

from __future__ import annotations

import itertools

import pytest
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_LAUNCH_REQUEST,
    TAG_RAY_NODE_KIND,
    TAG_RAY_USER_NODE_TYPE,
)

from tests.support.aws import REGION, group, live_instances, make_pools
from trainer.autoscaling.provider import PENDING_PREFIX, AsgNodeProvider

_names = itertools.count()


def _cluster(endpoint: str, **pools: dict) -> tuple[AsgNodeProvider, dict[str, str]]:
    name = f"c{next(_names)}"
    groups = make_pools(endpoint, name, {k.replace("_", "-"): v for k, v in pools.items()})
    return AsgNodeProvider({"region": REGION, "endpoint_url": endpoint}, name), groups


def _launch(provider: AsgNodeProvider, pool: str, count: int, request: str = "r") -> None:
    provider.create_node({}, {TAG_RAY_USER_NODE_TYPE: pool, TAG_RAY_LAUNCH_REQUEST: request}, count)


def test_lists_only_its_own_cluster_typed_by_pool(aws_endpoint):
    provider, groups = _cluster(
        aws_endpoint,
        head={"min": 1, "max": 1, "desired": 1, "role": "head", "types": ["m5.xlarge"]},
        gpu_spot={"max": 4, "market": "spot", "types": ["g5.4xlarge", "g5.2xlarge"]},
    )
    _other, other_groups = _cluster(aws_endpoint, gpu_spot={"max": 2, "desired": 2})
    nodes = provider.non_terminated_nodes({})
    assert nodes == live_instances(aws_endpoint, groups["head"])  # pools start at zero
    assert provider.node_tags(nodes[0])[TAG_RAY_NODE_KIND] == NODE_KIND_HEAD
    assert not set(nodes) & set(live_instances(aws_endpoint, other_groups["gpu-spot"]))
    assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_WORKER}) == []


def test_create_raises_desired_capped_at_max_and_nodes_are_protected(aws_endpoint):
    provider, groups = _cluster(aws_endpoint, gpu_spot={"max": 3, "market": "spot"})
    _launch(provider, "gpu-spot", 2)
    g = group(aws_endpoint, groups["gpu-spot"])
    assert g["DesiredCapacity"] == 2
    assert all(i["ProtectedFromScaleIn"] for i in g["Instances"])
    workers = provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "gpu-spot"})
    assert sorted(workers) == live_instances(aws_endpoint, groups["gpu-spot"])
    assert all(provider.is_running(w) for w in workers)
    assert all(provider.internal_ip(w).startswith("10.42.") for w in workers)
    with pytest.raises(RuntimeError, match="only 1 of 2"):
        _launch(provider, "gpu-spot", 2)
    assert group(aws_endpoint, groups["gpu-spot"])["DesiredCapacity"] == 3
    with pytest.raises(RuntimeError, match="maximum of 3"):
        _launch(provider, "gpu-spot", 1)
    with pytest.raises(RuntimeError, match="no Auto Scaling group"):
        _launch(provider, "gpu-nope", 1)


def test_terminate_ends_that_instance_with_decrement_never_below_min(aws_endpoint):
    provider, groups = _cluster(aws_endpoint, gpu_ondemand={"min": 1, "max": 3, "desired": 1})
    _launch(provider, "gpu-ondemand", 1)
    first, second = provider.non_terminated_nodes({})
    provider.terminate_node(second)
    assert group(aws_endpoint, groups["gpu-ondemand"])["DesiredCapacity"] == 1
    assert live_instances(aws_endpoint, groups["gpu-ondemand"]) == [first]
    assert provider.non_terminated_nodes({}) == [first]
    assert provider.is_terminated(second)
    # At min, a node ended is replaced by its group, not removed: desired stays at min.
    provider.terminate_node(first)
    assert group(aws_endpoint, groups["gpu-ondemand"])["DesiredCapacity"] == 1
    assert first not in provider.non_terminated_nodes({})


def _shortage(provider: AsgNodeProvider, produced: int) -> None:
    """AWS accepted the desired capacity but has no capacity: its answers show only the first
    `produced` instances (moto itself never runs short, so the shortage is applied to what
    DescribeAutoScalingGroups returns)."""

    def hide(parsed, **_):
        for g in parsed.get("AutoScalingGroups", []):
            g["Instances"] = g["Instances"][:produced]

    provider._asg.meta.events.register("after-call.auto-scaling.DescribeAutoScalingGroups", hide)


def test_a_launch_not_produced_is_listed_pending_and_giving_it_up_lowers_desired(aws_endpoint):
    provider, groups = _cluster(aws_endpoint, gpu_spot={"max": 3, "market": "spot"})
    _shortage(provider, produced=1)
    _launch(provider, "gpu-spot", 2, request="req-1")
    nodes = provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "gpu-spot"})
    pending = [n for n in nodes if n.startswith(PENDING_PREFIX)]
    assert len(nodes) == 2 and len(pending) == 1
    assert not provider.is_running(pending[0])
    assert provider.node_tags(pending[0])[TAG_RAY_LAUNCH_REQUEST] == "req-1"
    assert provider.internal_ip(pending[0]) is None
    provider.terminate_node(pending[0])  # v2 gives up on it after its allocation timeout
    assert group(aws_endpoint, groups["gpu-spot"])["DesiredCapacity"] == 1
    assert len(provider.non_terminated_nodes({})) == 1


def test_a_pending_launch_gives_way_to_the_instance_when_it_comes(aws_endpoint):
    provider, groups = _cluster(aws_endpoint, gpu_spot={"max": 3, "market": "spot"})
    produced = {"n": 0}

    def hide(parsed, **_):
        for g in parsed.get("AutoScalingGroups", []):
            g["Instances"] = g["Instances"][: produced["n"]]

    provider._asg.meta.events.register("after-call.auto-scaling.DescribeAutoScalingGroups", hide)
    _launch(provider, "gpu-spot", 1)
    assert provider.non_terminated_nodes({})[0].startswith(PENDING_PREFIX)
    produced["n"] = 1  # the capacity came
    assert provider.non_terminated_nodes({}) == live_instances(aws_endpoint, groups["gpu-spot"])
