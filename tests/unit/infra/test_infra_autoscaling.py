"""Pools that idle at zero: the ASGs Ray's autoscaler sizes, and the head that runs it."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import yaml
from infra_stack import FULL_CONFIG, INFRA, Stack, StackRunner, stack_file_config

from infra.settings import SettingsError, parse_settings
from infra.summary import pool_summary
from trainer.planner.catalog import get_instance

WORKERS = ("gpu-ondemand", "gpu-spot", "large-cpu-mem", "cpu")
FIXED = {**FULL_CONFIG, "raylift:autoscaling": {"enabled": False}}
WARM = {
    **FULL_CONFIG,
    "raylift:clusterName": "warm",
    "raylift:autoscaling": {"idleMinutes": 20, "launchTimeoutMinutes": 7},
    "raylift:pools": {
        **FULL_CONFIG["raylift:pools"],
        "gpuSpot": {"instanceTypes": ["g5.2xlarge", "g5.4xlarge"], "minNodes": 2, "maxNodes": 6},
    },
}


def _head_config(stack: Stack) -> tuple[dict[str, Any], dict[str, str]]:
    """The autoscaling config the head's user data writes, and the env its Ray gets."""
    script = stack.pools["head"].user_data
    lexer = shlex.shlex(script.split("\nAUTOSCALER_CONFIG=", 1)[1], posix=True)
    lexer.whitespace_split = True
    config = yaml.safe_load(lexer.get_token())
    args = next(x for x in script.splitlines() if x.lstrip().startswith("autoscaler_args=(-v"))
    tokens = shlex.split(args.split("(", 1)[1].rstrip(")"))
    env = dict(tokens[i + 1].split("=", 1) for i, t in enumerate(tokens) if t == "-e")
    return config, env


@pytest.fixture(scope="module")
def warm_stack(run_stack: StackRunner) -> Stack:
    return run_stack(WARM)


@pytest.mark.parametrize("pool", WORKERS)
def test_worker_pools_start_at_zero_and_the_autoscaler_owns_desired(full_stack: Stack, pool):
    p = full_stack.pools[pool]
    inputs = p.asg["inputs"]
    assert (inputs["minSize"], inputs["desiredCapacity"]) == (0, 0)
    assert inputs["maxSize"] == p.size > 0
    assert p.autoscaled, "pulumi up must not reset a pool the autoscaler sized"
    assert inputs["protectFromScaleIn"] is True, "only the autoscaler picks the node to end"
    hooks = [
        h["inputs"]
        for h in full_stack.of_type("aws:autoscaling/lifecycleHook:LifecycleHook")
        if h["name"] == f"full-{pool}-drain"
    ]
    assert [h["lifecycleTransition"] for h in hooks] == ["autoscaling:EC2_INSTANCE_TERMINATING"]


def test_the_head_stays_on_at_a_fixed_size(full_stack: Stack) -> None:
    head = full_stack.pools["head"]
    inputs = head.asg["inputs"]
    assert inputs["minSize"] == inputs["maxSize"] == inputs["desiredCapacity"] == 1
    assert not head.autoscaled and not inputs.get("protectFromScaleIn")


def test_min_nodes_keeps_warm_nodes(warm_stack: Stack) -> None:
    spot = warm_stack.pools["gpu-spot"].asg["inputs"]
    assert (spot["minSize"], spot["desiredCapacity"], spot["maxSize"]) == (2, 2, 6)
    config, env = _head_config(warm_stack)
    assert config["available_node_types"]["gpu-spot"]["min_workers"] == 2
    assert config["idle_timeout_minutes"] == 20
    assert env["RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S"] == "420"
    summary = warm_stack.outputs["summary"]["pools"]["gpu-spot"]
    assert summary["idleNodes"] == 2
    price = get_instance("g5.2xlarge").spot_usd_per_hour
    assert summary["idleUsdPerHour"] == pytest.approx(2 * price, abs=0.001)


def test_the_head_runs_autoscaler_v2_over_the_pools(full_stack: Stack) -> None:
    flags = full_stack.pools["head"].ray_start
    assert flags["autoscaling-config"] == "/etc/raylift/autoscaler.yaml"
    for pool in WORKERS:
        assert "autoscaling-config" not in full_stack.pools[pool].ray_start
    config, env = _head_config(full_stack)
    assert env["RAY_enable_autoscaler_v2"] == "1"
    assert float(env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"]) >= 600  # above a g5's boot
    assert config["provider"]["type"] == "external"
    assert config["provider"]["module"] == "trainer.autoscaling.provider.AsgNodeProvider"
    assert config["provider"]["raylift_cluster"] == "full"
    assert config["provider"]["disable_node_updaters"] is True
    assert config["idle_timeout_minutes"] == 10
    types = config["available_node_types"]
    assert set(types) == {"head", *WORKERS}
    assert types["head"]["max_workers"] == 0
    # Spot first: above on demand, which it equals in GPUs.
    assert types["gpu-spot"]["priority"] > types["gpu-ondemand"]["priority"]
    # The smallest listed spot type (g5.2xlarge), so no launch is made for work that won't fit.
    small = get_instance("g5.2xlarge")
    assert types["gpu-spot"]["resources"]["CPU"] == small.vcpus
    assert types["gpu-spot"]["resources"]["GPU"] == small.gpu_count
    assert types["gpu-ondemand"]["resources"]["GPU"] == get_instance("g5.12xlarge").gpu_count
    assert types["large-cpu-mem"]["labels"]["large_cpu_mem"] == "true"
    assert types["large-cpu-mem"]["resources"]["large_cpu_mem"] == 1
    assert types["cpu"]["resources"]["ccl"] == 1 and "GPU" not in types["cpu"]["resources"]
    for pool in WORKERS:
        p = full_stack.pools[pool]
        assert types[pool]["labels"] == p.labels
        assert (types[pool]["min_workers"], types[pool]["max_workers"]) == (0, p.size)
    assert config["max_workers"] == sum(full_stack.pools[p].size for p in WORKERS)


def test_the_head_may_size_only_its_own_cluster(full_stack: Stack) -> None:
    [policy] = [
        json.loads(p["inputs"]["policy"])
        for p in full_stack.of_type("aws:iam/rolePolicy:RolePolicy")
        if p["name"].endswith("-head-autoscaler")
    ]
    size = next(s for s in policy["Statement"] if s["Sid"] == "AutoscalerSize")
    assert set(size["Action"]) == {
        "autoscaling:SetDesiredCapacity",
        "autoscaling:TerminateInstanceInAutoScalingGroup",
    }
    assert size["Condition"] == {
        "StringEquals": {"autoscaling:ResourceTag/raylift:cluster": "full"}
    }


def test_without_autoscaling_pools_are_fixed_as_before(run_stack: StackRunner) -> None:
    stack = run_stack(FIXED)
    for pool in WORKERS:
        inputs = stack.pools[pool].asg["inputs"]
        assert inputs["minSize"] == inputs["maxSize"] == inputs["desiredCapacity"] > 0
        assert not stack.pools[pool].autoscaled
    assert "autoscaling-config" not in stack.pools["head"].ray_start
    assert "AUTOSCALER_CONFIG=''" in stack.pools["head"].user_data
    names = [p["name"] for p in stack.of_type("aws:iam/rolePolicy:RolePolicy")]
    assert not [n for n in names if n.endswith("-head-autoscaler")]
    assert stack.outputs["idleUsdPerHour"] == stack.outputs["summary"]["totalUsdPerHour"]


def test_an_idle_cluster_costs_the_head_alone(full_stack: Stack) -> None:
    head = get_instance("m5.2xlarge").on_demand_usd_per_hour
    assert full_stack.outputs["idleUsdPerHour"] == pytest.approx(head, abs=0.001)
    assert full_stack.outputs["summary"]["totalUsdPerHour"] > 10 * head


def test_size_is_a_deprecated_alias_of_max_nodes(full_stack: Stack) -> None:
    deprecated = [w for w in full_stack.warnings if "size is deprecated" in w]
    assert len(deprecated) == 4  # FULL_CONFIG sizes every worker pool with `size`
    assert any("raylift:pools.gpuSpot.size" in w for w in deprecated)
    assert not any("pools.head.size" in w for w in full_stack.warnings)


@pytest.mark.parametrize("preset", ["7b", "13b", "70b"])
def test_presets_use_max_nodes(run_stack: StackRunner, preset: str) -> None:
    stack = run_stack(stack_file_config(INFRA / "presets" / f"{preset}.yaml"))
    assert not [w for w in stack.warnings if "deprecated" in w]
    assert all(p.min_size == 0 for name, p in stack.pools.items() if name != "head")


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ({"gpuSpot": {"minNodes": 3, "maxNodes": 2}}, "minNodes 3 is above maxNodes 2"),
        ({"gpuSpot": {"size": 3, "maxNodes": 2}}, "set maxNodes only"),
        ({"largeCpuMem": {"maxNodes": 2}}, "largeCpuMem.maxNodes must be 0 or 1"),
    ],
)
def test_bounds_are_checked_at_preview(pools: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings({"image": {"tag": "trainer-gpu-1-abcdef0"}, "pools": pools})


def test_idle_night_saving_of_the_7b_preset() -> None:
    """What the docs quote: the 7b preset's cluster at full size vs idle, per 12 h night."""
    raw = stack_file_config(INFRA / "presets" / "7b.yaml")
    settings = parse_settings(
        {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("raylift:")}
    )
    summary = pool_summary(settings)
    fixed = summary["totalUsdPerHour"] - summary["pools"]["gpu-ondemand"]["usdPerHour"]
    assert summary["idleUsdPerHour"] == summary["pools"]["head"]["usdPerHour"]
    assert 12 * (fixed - summary["idleUsdPerHour"]) > 100
