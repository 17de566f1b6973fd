"""The node agent's side of Ray: which alive Ray node is this host's, and draining it for
preemption through the GCS (what `ray drain-node` does). Apart from the agent
(trainer.resilience.agent), which polls the metadata service and decides when to drain,
so that each reads on its own: Ray's private GCS client is met only here."""

from __future__ import annotations

import os
import time
from typing import Any


class DrainRejected(Exception):
    """The GCS refused the drain (it names why)."""


class NodeNotFound(Exception):
    """No single alive Ray node is this one (yet): Ray may still be starting."""


def gcs_client(gcs_address: str) -> Any:
    """Ray's GCS client (private to Ray: `ray drain-node` and the autoscaler SDK use it)."""
    from ray._raylet import GcsClient

    return GcsClient(address=gcs_address)


def default_gcs_address() -> str | None:
    """RAY_ADDRESS, else the address `ray start` wrote on this node (ray_current_cluster)."""
    from ray._private.utils import read_ray_address

    return os.environ.get("RAY_ADDRESS") or read_ray_address()


def drain_node(
    gcs_address: str, node_id: str, deadline_s: float | None, reason_message: str
) -> None:
    """Drain a Ray node for preemption, as `ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds deadline_s` does.

    `deadline_s` is seconds from now (None: no deadline). Ray Train's preemption watcher
    reports the drain to every worker group with ranks on that node; the deadline is when
    the node is expected to go, and Ray Train restarts the group then at the latest.
    Raises DrainRejected if the GCS refuses (a preemption drain is not rejectable by the
    raylet, but an unknown or dead node is refused).
    """
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else int((time.time() + max(deadline_s, 0.0)) * 1000)
    accepted, why = gcs_client(gcs_address).drain_node(
        node_id,
        autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION,
        reason_message,
        deadline_ms,
    )
    if not accepted:
        raise DrainRejected(f"node {node_id}: {why}")


def find_own_node(gcs_address: str, instance_id: str | None, ip: str | None) -> str:
    """The hex id of this host's alive Ray node: by cloud instance id, else by IP."""
    from ray.core.generated import gcs_pb2

    nodes = gcs_client(gcs_address).get_all_node_info(timeout=10)
    alive = [n for n in nodes.values() if n.state == gcs_pb2.GcsNodeInfo.ALIVE]
    for key, value, attr in (
        ("instance id", instance_id, "instance_id"),
        ("IP", ip, "node_manager_address"),
    ):
        if not value:
            continue
        matches = [n for n in alive if getattr(n, attr) == value]
        if len(matches) == 1:
            return matches[0].node_id.hex()
        if len(matches) > 1:
            raise NodeNotFound(
                f"{len(matches)} alive Ray nodes have {key} {value}; pass --node-id to choose"
            )
    raise NodeNotFound(
        f"no alive Ray node has instance id {instance_id or '-'} or IP {ip or '-'} "
        f"(of {len(alive)} alive)"
    )


def host_ip(gcs_address: str) -> str | None:
    """The address Ray itself picks for a node started without --node-ip-address."""
    from ray._private.services import get_node_ip_address

    try:
        return get_node_ip_address(gcs_address)
    except Exception:
        return None
