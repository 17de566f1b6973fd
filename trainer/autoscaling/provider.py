"""A Ray autoscaler node provider whose node types are our Auto Scaling groups.

Why not Ray's AWS provider: it launches one instance type per node type with no
mixed-instances policy and no spot fallback across types, and stops (not ends) on-demand
nodes. Our pools are ASGs already (spot diversification, the drain hook, replacement of a
node whose boot failed), so the autoscaler only has to move each group's desired capacity:

- ``create_node`` raises the group's desired capacity (never past its max);
- ``terminate_node`` ends that instance in its group and lowers desired with it;
- the node list is the groups' instances, found by the ``raylift:cluster`` tag, each
  typed by its group's ``raylift:pool`` tag (the node type's name; the nodes export the same
  name as ``RAY_NODE_TYPE_NAME`` and their instance id as ``RAY_CLOUD_INSTANCE_ID``).

A launch the group cannot fulfil (no spot capacity in any listed type) must reach the
autoscaler as a failed launch, so that v2 ranks the next node type (on demand) first. v2
learns that only from an instance that never starts Ray (ALLOCATION_TIMEOUT); it has no
notion of an instance that never appears. So each node asked for and not yet in its group is
listed as a *pending* instance (``pending-<pool>-<n>``) that never runs: when the group's
instance appears the pending one leaves the list and the real one takes its place; when it
never does, v2 gives up on it after its allocation timeout and ends it, which gives the
desired capacity back. The group's failed scaling activities say why, in the monitor's log.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import boto3
from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_LAUNCH_REQUEST,
    TAG_RAY_NODE_KIND,
    TAG_RAY_USER_NODE_TYPE,
)

log = logging.getLogger("trainer.autoscaling.provider")

CLUSTER_TAG = "raylift:cluster"
POOL_TAG = "raylift:pool"
ROLE_TAG = "raylift:role"
PENDING_PREFIX = "pending-"
# Lifecycle states of an instance that is on its way out (or gone): not a node any more.
_LEAVING = ("Terminating", "Terminated", "Detaching", "Detached", "Warmed")


@dataclass
class Pending:
    """A node asked for that its group has not produced yet."""

    node_id: str
    request_id: str
    since: float


@dataclass
class Group:
    """One pool's Auto Scaling group as last read."""

    name: str
    pool: str
    role: str
    min_size: int
    max_size: int
    desired: int
    instances: dict[str, str] = field(default_factory=dict)  # instance id -> lifecycle state


class AsgNodeProvider(NodeProvider):
    """Node types are pools; nodes are the pools' ASG instances (plus pending launches)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.cluster = provider_config.get("raylift_cluster", cluster_name)
        session = boto3.session.Session(region_name=provider_config["region"])
        endpoint = provider_config.get("endpoint_url")  # a test's AWS emulator on loopback
        self._asg = session.client("autoscaling", endpoint_url=endpoint)
        self._ec2 = session.client("ec2", endpoint_url=endpoint)
        self._lock = threading.RLock()
        self._groups: dict[str, Group] = {}
        self._pending: dict[str, list[Pending]] = {}
        self._extra_tags: dict[str, dict[str, str]] = {}
        self._ips: dict[str, str] = {}
        self._counter = itertools.count()
        self._reported_failures: set[str] = set()

    # --- reading the groups -------------------------------------------------------------

    def _refresh(self) -> None:
        groups: dict[str, Group] = {}
        pages = self._asg.get_paginator("describe_auto_scaling_groups").paginate(
            Filters=[{"Name": f"tag:{CLUSTER_TAG}", "Values": [self.cluster]}]
        )
        for page in pages:
            for g in page["AutoScalingGroups"]:
                tags = {t["Key"]: t["Value"] for t in g.get("Tags", [])}
                if tags.get(CLUSTER_TAG) != self.cluster or POOL_TAG not in tags:
                    continue
                groups[tags[POOL_TAG]] = Group(
                    name=g["AutoScalingGroupName"],
                    pool=tags[POOL_TAG],
                    role=tags.get(ROLE_TAG, "worker"),
                    min_size=g["MinSize"],
                    max_size=g["MaxSize"],
                    desired=g["DesiredCapacity"],
                    instances={
                        i["InstanceId"]: i["LifecycleState"]
                        for i in g.get("Instances", [])
                        if not i["LifecycleState"].startswith(_LEAVING)
                    },
                )
        with self._lock:
            self._groups = groups
            for pool, group in groups.items():
                pending = self._pending.get(pool, [])
                # The group produced some of what was asked for: those pending nodes give way
                # to the real instances (oldest first), which the autoscaler adopts by type.
                missing = max(0, group.desired - len(group.instances))
                if len(pending) > missing:
                    del pending[: len(pending) - missing]
                if pending:
                    self._explain_wait(group, pending[0])

    def _explain_wait(self, group: Group, oldest: Pending) -> None:
        """Say (once per failed activity) why the group has not produced a node yet."""
        try:
            activities = self._asg.describe_scaling_activities(
                AutoScalingGroupName=group.name, MaxRecords=10
            )["Activities"]
        except Exception as exc:  # a read for the log only: never stop the autoscaler
            log.debug("scaling activities of %s unreadable: %s", group.name, exc)
            return
        for act in activities:
            failed = act.get("StatusCode") in ("Failed", "Cancelled")
            if failed and act["ActivityId"] not in self._reported_failures:
                self._reported_failures.add(act["ActivityId"])
                log.warning(
                    "pool %s (%s): launch not fulfilled for %.0f s: %s",
                    group.pool,
                    group.name,
                    time.time() - oldest.since,
                    act.get("StatusMessage") or act.get("Description", ""),
                )

    def _find(self, node_id: str) -> tuple[Group | None, Pending | None]:
        with self._lock:
            for group in self._groups.values():
                if node_id in group.instances:
                    return group, None
            for pool, pending in self._pending.items():
                for p in pending:
                    if p.node_id == node_id:
                        return self._groups.get(pool), p
        return None, None

    # --- NodeProvider ---------------------------------------------------------------------

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        self._refresh()
        with self._lock:
            ids = [i for g in self._groups.values() for i in g.instances]
            ids += [p.node_id for pending in self._pending.values() for p in pending]
        return [
            i for i in ids if all(self.node_tags(i).get(k) == v for k, v in tag_filters.items())
        ]

    def is_running(self, node_id: str) -> bool:
        group, pending = self._find(node_id)
        return group is not None and pending is None

    def is_terminated(self, node_id: str) -> bool:
        group, _ = self._find(node_id)
        return group is None

    def node_tags(self, node_id: str) -> dict[str, str]:
        group, pending = self._find(node_id)
        if group is None:
            return {}
        tags = {
            TAG_RAY_NODE_KIND: NODE_KIND_HEAD if group.role == "head" else NODE_KIND_WORKER,
            TAG_RAY_USER_NODE_TYPE: group.pool,
            TAG_RAY_LAUNCH_REQUEST: pending.request_id if pending else "",
        }
        return {**tags, **self._extra_tags.get(node_id, {})}

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self._lock:
            self._extra_tags.setdefault(node_id, {}).update(tags)

    def internal_ip(self, node_id: str) -> str | None:
        if node_id.startswith(PENDING_PREFIX):
            return None
        if node_id not in self._ips:
            reservations = self._ec2.describe_instances(InstanceIds=[node_id])["Reservations"]
            for r in reservations:
                for inst in r["Instances"]:
                    self._ips[inst["InstanceId"]] = inst.get("PrivateIpAddress", "")
        return self._ips.get(node_id) or None

    def external_ip(self, node_id: str) -> str | None:
        # Nodes live in private subnets; the autoscaler never needs to reach them.
        return None

    def create_node(
        self, node_config: dict[str, Any], tags: dict[str, str], count: int
    ) -> dict[str, Any]:
        pool = tags[TAG_RAY_USER_NODE_TYPE]
        with self._lock:
            if not self._groups:
                self._refresh()
            group = self._groups.get(pool)
            if group is None:
                raise RuntimeError(
                    f"no Auto Scaling group tagged {POOL_TAG}={pool} in {self.cluster}"
                )
            target = min(group.desired + count, group.max_size)
            granted = target - group.desired
            if granted <= 0:
                raise RuntimeError(
                    f"pool {pool} is at its maximum of {group.max_size} nodes "
                    f"(raylift:pools.*.maxNodes)"
                )
            self._asg.set_desired_capacity(
                AutoScalingGroupName=group.name, DesiredCapacity=target, HonorCooldown=False
            )
            group.desired = target
            now = time.time()
            pending = self._pending.setdefault(pool, [])
            for _ in range(granted):
                node_id = f"{PENDING_PREFIX}{pool}-{next(self._counter)}"
                pending.append(Pending(node_id, tags.get(TAG_RAY_LAUNCH_REQUEST, ""), now))
        log.info("pool %s: desired %d -> %d (%s)", pool, target - granted, target, group.name)
        if granted < count:
            raise RuntimeError(
                f"pool {pool}: only {granted} of {count} nodes fit under its maximum"
            )
        return {}

    def terminate_node(self, node_id: str) -> dict[str, Any]:
        group, pending = self._find(node_id)
        if group is None:
            return {}  # gone already
        with self._lock:
            if pending is not None:
                # Give back a launch that never came: the group stops trying (its instances
                # are protected from scale-in, so lowering desired ends none of them).
                self._pending[group.pool].remove(pending)
                floor = max(group.min_size, len(group.instances))
                if group.desired > floor:
                    group.desired -= 1
                    self._asg.set_desired_capacity(
                        AutoScalingGroupName=group.name,
                        DesiredCapacity=group.desired,
                        HonorCooldown=False,
                    )
                log.info(
                    "pool %s: gave up a launch (%s), desired %d", group.pool, node_id, group.desired
                )
                return {}
            # Never below min: a team's warm nodes are replaced, not removed.
            decrement = group.desired > group.min_size
            self._asg.terminate_instance_in_auto_scaling_group(
                InstanceId=node_id, ShouldDecrementDesiredCapacity=decrement
            )
            group.instances.pop(node_id, None)
            if decrement:
                group.desired -= 1
        log.info("pool %s: ended %s (desired %d)", group.pool, node_id, group.desired)
        return {}
