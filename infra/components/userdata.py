"""Render the node bootstrap script from `userdata.sh.tmpl`.

The script lives in a template file (not a Python string) so it can be read, diffed and
shellchecked as shell. Placeholders are `@@{NAME}`: bash never uses `@@`, so `$VAR` and
`${VAR}` in the template stay bash's. Every value is shell-quoted here, once, so a label or
path can never inject shell syntax, and a missing or unknown placeholder is an error.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from infra.settings import Market, RaySettings

TEMPLATE_PATH = Path(__file__).with_name("userdata.sh.tmpl")
# The images' user (images/base/Dockerfile: `useradd --uid 1000`); it must own what it writes.
CONTAINER_UID = 1000
# Each boot step: 30 tries, 10 s apart (5 minutes), then the node gives up and is replaced.
BOOT_ATTEMPTS = 30
RETRY_DELAY_S = 10
# The node agent (trainer/resilience/agent.py, started by the image's entrypoint on worker
# nodes) polls this every AGENT_INTERVAL_S and drains its Ray node AGENT_MARGIN_S before a
# spot notice's time: of the two minutes' notice, ~105 s go to the emergency checkpoint.
IMDS_ENDPOINT = "http://169.254.169.254"
AGENT_INTERVAL_S = 5
AGENT_MARGIN_S = 15
# Where the head's autoscaling config lives, on the host and (mounted) in the container.
AUTOSCALER_CONFIG_PATH = "/etc/raylift/autoscaler.yaml"
# Where a node's instance-store NVMe is mounted, on the host and in the container: the path
# the Ray template's ZeRO-3 NVMe offload config names (nvme_path).
LOCAL_STORAGE_PATH = "/mnt/local_storage"


def sq(value: str) -> str:
    """Single-quote for bash, always: shlex.quote leaves `head` bare, and `ROLE=head` reads to
    shellcheck (and to people) like running a command named head."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


class _Template(string.Template):
    delimiter = "@@"
    idpattern = r"[A-Z][A-Z0-9_]*"


@dataclass(frozen=True)
class NodeBootstrap:
    """Everything a node needs to join the cluster (resolved values, not Pulumi outputs)."""

    role: Literal["head", "worker"]
    pool: str
    market: Market
    cluster_name: str
    region: str
    efs_id: str
    mount_path: str
    image: str
    head_fqdn: str
    ray: RaySettings
    use_gpus: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)
    num_cpus: int | None = None
    token_secret_arn: str | None = None
    hosted_zone_id: str | None = None
    # The termination lifecycle hook the node agent completes; None where the pool has none.
    lifecycle_hook: str | None = None
    # Head only, with autoscaling: Ray's autoscaling config (YAML) and the environment its
    # Ray runs with (autoscaler v2 on, the launch timeout).
    autoscaler_config: str | None = None
    autoscaler_env: Mapping[str, str] = field(default_factory=dict)


def format_labels(labels: Mapping[str, str]) -> str:
    """Ray 2.60's `ray start --labels` form: "key1=val1,key2=val2" (ray/scripts/scripts.py)."""
    for key, value in labels.items():
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.\-/]*[A-Za-z0-9])?", key) or not re.fullmatch(
            r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?", value
        ):
            raise ValueError(f"Ray label {key}={value} does not follow Kubernetes label syntax")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def format_resources(resources: Mapping[str, float]) -> str:
    """`ray start --resources` takes a JSON object; whole numbers are written as integers."""
    clean = {k: int(v) if float(v).is_integer() else v for k, v in sorted(resources.items())}
    return json.dumps(clean, separators=(",", ":"))


def _role_args(node: NodeBootstrap) -> list[str]:
    r = node.ray
    if node.role == "head":
        return [
            "--head",
            f"--port={r.gcs_port}",
            # Bound on all interfaces so other nodes (SG-restricted) and an SSM port forward
            # (which connects to localhost) both reach it; token auth guards every request.
            "--dashboard-host=0.0.0.0",
            f"--dashboard-port={r.dashboard_port}",
            f"--ray-client-server-port={r.client_server_port}",
            *([f"--autoscaling-config={AUTOSCALER_CONFIG_PATH}"] if node.autoscaler_config else []),
        ]
    return [f"--address={node.head_fqdn}:{r.gcs_port}"]


def strip_comments(script: str) -> str:
    """The template's whole-line comments are for its readers; EC2 refuses user data over
    16 KB, so the rendered script keeps only its shebangs, its title line and shellcheck's
    directives (the head's, with the autoscaler's config, passed the limit with them)."""
    keep = ("#!", "# Raylift node bootstrap", "# shellcheck")
    return "".join(
        line
        for line in script.splitlines(keepends=True)
        if not line.lstrip().startswith("#") or line.lstrip().startswith(keep)
    )


def render_user_data(node: NodeBootstrap) -> str:
    """Fill the template; raises KeyError/ValueError rather than emit a half-rendered script."""
    q = sq
    r = node.ray
    node_args = [] if node.num_cpus is None else [f"--num-cpus={node.num_cpus}"]
    if not re.fullmatch(r"/[A-Za-z0-9._/-]+", node.mount_path):
        raise ValueError(f"mount path {node.mount_path!r} cannot go into a systemd unit as is")
    values = {
        "ROLE": q(node.role),
        "POOL": q(node.pool),
        "MARKET": q(node.market),
        "CONTAINER_UID": str(CONTAINER_UID),
        "LIFECYCLE_HOOK": q(node.lifecycle_hook or ""),
        "BOOT_ATTEMPTS": str(BOOT_ATTEMPTS),
        "RETRY_DELAY": str(RETRY_DELAY_S),
        "IMDS_ENDPOINT": q(IMDS_ENDPOINT),
        "AGENT_INTERVAL_S": str(AGENT_INTERVAL_S),
        "AGENT_MARGIN_S": str(AGENT_MARGIN_S),
        "UNIT_MOUNT_PATH": node.mount_path,
        "CLUSTER_NAME": q(node.cluster_name),
        "REGION": q(node.region),
        "EFS_ID": q(node.efs_id),
        "MOUNT_PATH": q(node.mount_path),
        "LOCAL_STORAGE": q(LOCAL_STORAGE_PATH),
        "TOKEN_SECRET_ARN": q(node.token_secret_arn or ""),
        "HOSTED_ZONE_ID": q(node.hosted_zone_id or ""),
        "HEAD_FQDN": q(node.head_fqdn),
        "IMAGE": q(node.image),
        "ECR_REGISTRY": q(node.image.split("/", 1)[0]),
        "USE_GPUS": "1" if node.use_gpus else "0",
        "TOKEN_AUTH": "1" if node.token_secret_arn else "0",
        "RAY_ROLE_ARGS": " ".join(q(a) for a in _role_args(node)),
        "RAY_NODE_ARGS": " ".join(q(a) for a in node_args),
        "RAY_LABELS": q(format_labels(node.labels)),
        "RAY_RESOURCES": q(format_resources(node.resources)),
        "NODE_MANAGER_PORT": str(r.node_manager_port),
        "OBJECT_MANAGER_PORT": str(r.object_manager_port),
        "RUNTIME_ENV_AGENT_PORT": str(r.runtime_env_agent_port),
        "DASHBOARD_AGENT_GRPC_PORT": str(r.dashboard_agent_grpc_port),
        "DASHBOARD_AGENT_LISTEN_PORT": str(r.dashboard_agent_listen_port),
        "METRICS_EXPORT_PORT": str(r.metrics_export_port),
        "MIN_WORKER_PORT": str(r.min_worker_port),
        "MAX_WORKER_PORT": str(r.max_worker_port),
        "AUTOSCALER_CONFIG": q(node.autoscaler_config or ""),
        "AUTOSCALER_ENV_ARGS": " ".join(
            f"-e {q(f'{k}={v}')}" for k, v in sorted(node.autoscaler_env.items())
        ),
    }
    template = _Template(strip_comments(TEMPLATE_PATH.read_text(encoding="utf-8")))
    used = {m.group("braced") for m in template.pattern.finditer(template.template)} - {None}
    unused = set(values) - used
    if unused:
        raise ValueError(f"userdata.sh.tmpl no longer uses {sorted(unused)}; update the renderer")
    return template.substitute(values)
