"""The head's autoscaling config: Ray's autoscaler v2 with our node provider over the pools.

Pure (no Pulumi), so a test renders the same config the head gets and runs Ray's real
autoscaler on it. One node type per worker pool, named as the pool (nodes export that name
as ``RAY_NODE_TYPE_NAME``), with what the autoscaler needs to choose between pools:

- resources of the pool's *smallest* listed type (a spot pool may hand out any of them, and
  the autoscaler must never launch a node for work that would not fit on it);
- the pool's Ray labels, so a label selector (rank 0 on ``large_cpu_mem``) launches the
  right pool;
- a priority: spot above on demand. For equal resources v2 launches the higher priority
  first, and after a launch that never produced a running node it ranks the other type
  first for a while (RAY_AUTOSCALER_AVAILABILITY_RECOVERY_S): spot first, on demand when
  spot has no capacity.
"""

from __future__ import annotations

from typing import Any

from infra.catalog import load_catalog
from infra.settings import POOL_MARKETS, PoolSettings, StackSettings

# Imported by Ray's monitor on the head, inside the trainer image.
PROVIDER_MODULE = "trainer.autoscaling.provider.AsgNodeProvider"
# Where the head's user data writes the config (the container sees the same path).
CONFIG_PATH = "/etc/raylift/autoscaler.yaml"
PRIORITY = {"spot": 10, "on-demand": 1}
# Of a node's RAM, what Ray offers as its `memory` resource (the rest is the object store
# and the system): the autoscaler must not promise more than the node will report.
MEMORY_FRACTION = 0.6


def pool_labels(pool: str, extra: dict[str, str]) -> dict[str, str]:
    """Ray node labels every pool carries, so jobs can select by pool and market."""
    labels = {"pool": pool, "market": POOL_MARKETS[pool]}
    if pool == "large-cpu-mem":
        labels["large_cpu_mem"] = "true"
    return {**labels, **extra}


def pool_resources(pool: str, extra: dict[str, float]) -> dict[str, float]:
    """Custom resources; `large_cpu_mem` matches Ray's Llama-2 template's rank-0 placement."""
    resources: dict[str, float] = {"large_cpu_mem": 1} if pool == "large-cpu-mem" else {}
    return {**resources, **extra}


def node_type_resources(pool: str, spec: PoolSettings) -> dict[str, float]:
    """What one node of the pool offers Ray, counting the smallest listed instance type."""
    instances = load_catalog().instances
    smallest = min((instances[t] for t in spec.instance_types), key=lambda i: (i.vcpus, i.ram_gib))
    resources: dict[str, float] = {
        "CPU": spec.num_cpus if spec.num_cpus is not None else smallest.vcpus,
        "memory": int(smallest.ram_gib * MEMORY_FRACTION * 2**30),
    }
    if smallest.gpu_count:
        resources["GPU"] = smallest.gpu_count
    return {**resources, **pool_resources(pool, spec.resources)}


def autoscaler_config(settings: StackSettings, region: str) -> dict[str, Any]:
    """The YAML (as a dict) given to `ray start --head --autoscaling-config`."""
    node_types: dict[str, Any] = {
        "head": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
    }
    for pool, spec in settings.pools.by_name().items():
        if pool == "head" or spec.capacity == 0:
            continue
        node_types[pool] = {
            "resources": node_type_resources(pool, spec),
            "labels": pool_labels(pool, spec.labels),
            "min_workers": spec.min_nodes,
            "max_workers": spec.capacity,
            "priority": PRIORITY[POOL_MARKETS[pool]],
            "node_config": {},
        }
    return {
        "cluster_name": settings.cluster_name,
        "max_workers": sum(t["max_workers"] for k, t in node_types.items() if k != "head"),
        "idle_timeout_minutes": settings.autoscaling.idle_minutes,
        "upscaling_speed": 1.0,
        "provider": {
            "type": "external",
            "module": PROVIDER_MODULE,
            "region": region,
            "raylift_cluster": settings.cluster_name,
            # Nodes start Ray themselves (their systemd unit); nothing to ssh or install.
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "head_node_type": "head",
        "available_node_types": node_types,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def autoscaler_env(settings: StackSettings) -> dict[str, str]:
    """Environment of the head's Ray: v2 on, and how long a launch may take to run Ray."""
    timeout_s = int(settings.autoscaling.launch_timeout_minutes * 60)
    return {
        "RAY_enable_autoscaler_v2": "1",
        "RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S": str(timeout_s),
        # Ray Train retries a worker group that has not started within this; nodes boot
        # from zero, so it waits as long as a launch may take.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(timeout_s),
        "RAYLIFT_AUTOSCALER_CONFIG": CONFIG_PATH,
    }
