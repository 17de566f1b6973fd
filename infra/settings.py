"""Typed stack settings: everything `Pulumi.<stack>.yaml` may say, validated before any resource.

Why a model instead of scattered ``config.get`` calls: a typo in a stack file (``gpuSpto``) or a
pool that names an instance type the catalog doesn't know must fail at ``pulumi preview`` with one
line that names the key, not an hour later as a node that never joins the cluster. Keys in the
stack file are camelCase (Pulumi's convention); the Python side uses snake_case.

This module imports no Pulumi, so it is unit-testable and reusable by tools that read stack files.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from infra.catalog import load_catalog

Market = Literal["on-demand", "spot"]

# Canonical pool names; they are also the `pool=` Ray label and the ASG/launch-template names.
POOL_KEYS: dict[str, str] = {
    "head": "head",
    "gpu_on_demand": "gpu-ondemand",
    "gpu_spot": "gpu-spot",
    "large_cpu_mem": "large-cpu-mem",
    "cpu": "cpu",
}
# Each pool's market is a property of the pool, not a knob: rank 0 and the head on spot would
# turn every reclaim into a lost run, and the point of gpu-spot is that it *is* spot.
POOL_MARKETS: dict[str, Market] = {
    "head": "on-demand",
    "gpu-ondemand": "on-demand",
    "gpu-spot": "spot",
    "large-cpu-mem": "on-demand",
    "cpu": "on-demand",
}

# Ubuntu 22.04 Deep Learning Base AMI: NVIDIA driver, Docker, the NVIDIA container toolkit,
# the AWS CLI and nfs-common preinstalled. This SSM parameter always names AWS's newest build;
# the program resolves it once and records the answer in the stack (components/ami.py), so
# every node of a cluster, including replacements launched weeks later, runs the same driver.
DEFAULT_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)

# What `make push` writes (tools/image.py push): the exact trainer-gpu tag it pushed. Relative
# paths are taken from infra/, so the default is the repository's build/image-tag.
DEFAULT_TAG_FILE = "../build/image-tag"


class _Model(BaseModel):
    """camelCase in YAML, snake_case in Python, and unknown keys are errors (typos fail loudly)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class NetworkSettings(_Model):
    vpc_cidr: str = "10.42.0.0/16"
    # Spot capacity is per AZ: more AZs = more spot pools for the price-capacity-optimized pick.
    availability_zones: list[str] | None = Field(default=None, min_length=1, max_length=6)
    az_count: int = Field(default=3, ge=1, le=6)
    # "single" keeps cost at one NAT; "per-az" survives an AZ outage. There is no "none": the
    # head registers its DNS name through the Route53 API, which has no VPC endpoint, and
    # training pulls models/packages from the internet anyway.
    nat_gateway: Literal["single", "per-az"] = "single"
    # ECR/SSM/Secrets Manager/STS interface endpoints (~$7/month per endpoint per AZ): image
    # pulls (tens of GB per node) then skip the NAT's per-GB charge. The S3 gateway endpoint is
    # always created (it is free and keeps checkpoint traffic off the NAT).
    interface_endpoints: bool = False
    existing_vpc_id: str | None = None
    existing_private_subnet_ids: list[str] | None = None

    @field_validator("vpc_cidr")
    @classmethod
    def _cidr_fits_subnets(cls, value: str) -> str:
        net = ipaddress.ip_network(value)
        if net.prefixlen > 16:
            raise ValueError("vpcCidr must be a /16 or larger (private subnets are /19 each)")
        return value

    @model_validator(mode="after")
    def _existing_network_is_whole(self) -> NetworkSettings:
        if (self.existing_vpc_id is None) != (self.existing_private_subnet_ids is None):
            raise ValueError("set both existingVpcId and existingPrivateSubnetIds, or neither")
        if self.existing_private_subnet_ids is not None and not self.existing_private_subnet_ids:
            raise ValueError("existingPrivateSubnetIds must list at least one subnet")
        return self


class StorageSettings(_Model):
    bucket_name: str | None = None
    versioning: bool = True
    checkpoint_prefix: str = "checkpoints/"
    # Checkpoints older than this are deleted; 0 keeps them forever.
    checkpoint_expiration_days: int = Field(default=30, ge=0)
    noncurrent_version_expiration_days: int = Field(default=7, ge=1)
    # A customer-managed KMS key ARN for S3 and EFS; unset = AWS-managed keys (SSE-S3 / EFS).
    kms_key_arn: str | None = None
    force_destroy: bool = False
    efs_throughput_mode: Literal["elastic", "bursting"] = "elastic"
    mount_path: str = "/mnt/shared"

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or value == "/":
            raise ValueError("mountPath must be an absolute directory other than /")
        # It is written into a systemd unit (RequiresMountsFor=) and fstab, which quote
        # differently from bash: plain path characters only.
        if not re.fullmatch(r"/[A-Za-z0-9._/-]+", value):
            raise ValueError("mountPath may only contain letters, digits, '.', '_', '-' and '/'")
        return value.rstrip("/")


class RegistrySettings(_Model):
    prefix: str = "raylift"
    repositories: list[str] = Field(default_factory=lambda: ["base", "bnb", "ccl", "trainer"])
    immutable_tags: bool = True
    force_delete: bool = False


class ImageSettings(_Model):
    """Which image the nodes run: the exact tag `make push` produced, never a moving one.

    `tag` wins; without it the tag is read from `tagFile` (what `make push` writes). With
    neither, the stack creates everything but the node pools (the first `pulumi up`, which
    makes the ECR repositories that `make push` needs).
    """

    repository: str = "trainer"
    tag: str | None = None
    tag_file: str = DEFAULT_TAG_FILE
    # The CPU (oneCCL) variant; by default derived from `tag` (trainer-gpu-X -> trainer-cpu-X).
    cpu_tag: str | None = None

    @field_validator("tag", "cpu_tag")
    @classmethod
    def _not_moving(cls, value: str | None) -> str | None:
        if value is not None and (value in {"", "latest"} or value.endswith("-latest")):
            raise ValueError(f"image tags must be exact, not {value!r} (a moving tag)")
        return value


class RaySettings(_Model):
    """Ray ports are pinned so the security group can list them instead of opening ranges."""

    token_auth: bool = True
    gcs_port: int = 6379
    dashboard_port: int = 8265
    client_server_port: int = 10001
    node_manager_port: int = 6380
    object_manager_port: int = 6381
    runtime_env_agent_port: int = 6382
    dashboard_agent_grpc_port: int = 6383
    # Ray's default (52365) sits inside the collective range below, so it is moved.
    dashboard_agent_listen_port: int = 6384
    metrics_export_port: int = 8090
    min_worker_port: int = 10002
    max_worker_port: int = 10999
    # NCCL/gloo/oneCCL and torch's TCPStore bind ephemeral ports between training workers;
    # Linux's default ip_local_port_range. Opened only to the cluster's own security group.
    collective_port_range: tuple[int, int] = (32768, 60999)

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> RaySettings:
        singles = [
            self.gcs_port,
            self.dashboard_port,
            self.client_server_port,
            self.node_manager_port,
            self.object_manager_port,
            self.runtime_env_agent_port,
            self.dashboard_agent_grpc_port,
            self.dashboard_agent_listen_port,
            self.metrics_export_port,
        ]
        if len(set(singles)) != len(singles):
            raise ValueError("ray ports must be distinct")
        ranges = [(self.min_worker_port, self.max_worker_port), self.collective_port_range]
        for low, high in ranges:
            if not 1024 <= low <= high <= 65535:
                raise ValueError(f"bad port range {low}-{high}")
            if any(low <= port <= high for port in singles):
                raise ValueError(f"port range {low}-{high} overlaps a fixed Ray port")
        (a_low, a_high), (b_low, b_high) = ranges
        if a_low <= b_high and b_low <= a_high:
            raise ValueError("worker port range overlaps the collective port range")
        return self


class PoolSettings(_Model):
    instance_types: list[str] = Field(min_length=1)
    # The most nodes the pool may hold. Ray's autoscaler sizes the pool between minNodes and
    # maxNodes to the jobs; with autoscaling off the pool holds maxNodes all the time.
    max_nodes: int | None = Field(default=None, ge=0)
    # Nodes kept up while idle (warm nodes); 0 costs nothing while no job runs.
    min_nodes: int = Field(default=0, ge=0)
    # Deprecated alias of maxNodes (the fixed size before autoscaling); the head's size is 1.
    size: int = Field(default=0, ge=0)
    root_volume_gib: int = Field(default=200, ge=50)
    labels: dict[str, str] = Field(default_factory=dict)
    resources: dict[str, float] = Field(default_factory=dict)
    # gp3 beyond its 125 MB/s / 3000 IOPS baseline: image extraction (tens of GB per node) and
    # checkpoint staging are bound by the root disk (~$0.04 per MB/s-month above baseline).
    root_volume_throughput: int = Field(default=1000, ge=125, le=1000)
    root_volume_iops: int = Field(default=6000, ge=3000, le=16000)
    num_cpus: int | None = Field(default=None, ge=0)
    # An explicit AMI id for this pool; unset = the AMI the stack pinned (DEFAULT_AMI_PARAMETER).
    ami: str | None = Field(default=None, pattern=r"^ami-[0-9a-f]{8,17}$")
    root_device_name: str = "/dev/sda1"

    @property
    def capacity(self) -> int:
        """maxNodes, or the deprecated size where maxNodes is unset."""
        return self.size if self.max_nodes is None else self.max_nodes

    @model_validator(mode="after")
    def _bounds(self) -> PoolSettings:
        if self.max_nodes is not None and "size" in self.model_fields_set:
            raise ValueError("set maxNodes only (size is its deprecated alias)")
        if self.min_nodes > self.capacity:
            raise ValueError(f"minNodes {self.min_nodes} is above maxNodes {self.capacity}")
        return self

    @model_validator(mode="after")
    def _gp3_ratio(self) -> PoolSettings:
        # AWS caps gp3 at 0.25 MB/s of throughput per provisioned IOPS.
        if self.root_volume_throughput > self.root_volume_iops // 4:
            raise ValueError(
                f"rootVolumeThroughput {self.root_volume_throughput} needs rootVolumeIops >= "
                f"{self.root_volume_throughput * 4} (gp3 allows 0.25 MB/s per IOPS)"
            )
        return self

    @field_validator("instance_types")
    @classmethod
    def _known_types(cls, value: list[str]) -> list[str]:
        catalog = load_catalog()
        known = catalog.instances
        unknown = [t for t in value if t not in known]
        if unknown:
            raise ValueError(
                f"unknown instance type(s) {unknown}; add them to {catalog.display_path}"
            )
        if len(set(value)) != len(value):
            raise ValueError("instance types must not repeat")
        gpu_counts = {known[t].gpu_count for t in value}
        if len(gpu_counts) > 1:
            # Ray Train gives one GPU per worker; mixing 1- and 8-GPU nodes in one pool makes
            # the pool's GPU total depend on what spot happened to hand out.
            raise ValueError(f"instance types in one pool must have the same GPU count: {value}")
        return value


def _default_pools() -> dict[str, Any]:
    return {
        "head": {"instanceTypes": ["m5.xlarge"], "size": 1, "rootVolumeGib": 100, "numCpus": 0},
        "gpuOnDemand": {"instanceTypes": ["g5.4xlarge"]},
        "gpuSpot": {"instanceTypes": ["g5.4xlarge", "g5.8xlarge", "g5.2xlarge"]},
        # Sized for the 70b preset's rank 0: the full model is gathered here at checkpoint time
        # (~4 B/param = 280 GB for 70B) on top of this node's offloaded optimizer shards; rank 0
        # is a GPU training worker, so the node needs a GPU as well as the RAM.
        "largeCpuMem": {"instanceTypes": ["g5.48xlarge"], "maxNodes": 1, "rootVolumeGib": 500},
        "cpu": {"instanceTypes": ["c6i.16xlarge"]},
    }


class PoolsSettings(_Model):
    head: PoolSettings
    gpu_on_demand: PoolSettings
    gpu_spot: PoolSettings
    large_cpu_mem: PoolSettings
    cpu: PoolSettings

    @model_validator(mode="after")
    def _shape(self) -> PoolsSettings:
        if self.head.capacity != 1 or self.head.min_nodes not in (0, 1):
            raise ValueError("pools.head.size must be 1 (one Ray head per cluster)")
        for key in ("head", "gpu_on_demand", "large_cpu_mem", "cpu"):
            pool: PoolSettings = getattr(self, key)
            if len(pool.instance_types) != 1:
                raise ValueError(
                    f"pools.{to_camel(key)} is on-demand and takes exactly one instance type"
                )
        if self.large_cpu_mem.capacity > 1:
            raise ValueError("pools.largeCpuMem.maxNodes must be 0 or 1 (it hosts rank 0)")
        return self

    def deprecations(self) -> list[str]:
        """One line per worker pool still sized with `size` (the head's size is its own)."""
        return [
            f"raylift:pools.{to_camel(key)}.size is deprecated: it is now maxNodes (the pool "
            f"grows to it with the jobs and idles at minNodes); rename it"
            for key in POOL_KEYS
            if key != "head" and "size" in getattr(self, key).model_fields_set
        ]

    def by_name(self) -> dict[str, PoolSettings]:
        """Pools keyed by their canonical (label) name, in creation order."""
        return {POOL_KEYS[key]: getattr(self, key) for key in POOL_KEYS}


class AutoscalingSettings(_Model):
    """Ray's autoscaler v2 on the head sizes the worker pools to the jobs (spot first).

    Off: every pool holds maxNodes all the time, as before autoscaling."""

    enabled: bool = True
    # A worker idle this long is drained and ended (and its pool shrinks with it).
    idle_minutes: float = Field(default=10, gt=0)
    # A node asked for that runs no Ray this long after is given up (no capacity, or a boot
    # that failed), and the autoscaler turns to the next node type: spot to on demand. It
    # covers an instance's boot and image pull, so it is longer than a g5 needs for both.
    launch_timeout_minutes: float = Field(default=10, gt=0)


class StackSettings(_Model):
    cluster_name: str = Field(default="raylift", pattern=r"^[a-z][a-z0-9-]{1,30}$")
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    image: ImageSettings = Field(default_factory=ImageSettings)
    ami_parameter: str = DEFAULT_AMI_PARAMETER
    # An email address that receives the Auto Scaling groups' launch failures (no capacity,
    # quota exceeded); unset = subscribe to the `capacityAlertsTopic` output yourself.
    alert_email: str | None = Field(default=None, pattern=r"^[^@\s]+@[^@\s]+$")
    ray: RaySettings = Field(default_factory=RaySettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    pools: PoolsSettings

    @model_validator(mode="after")
    def _image_repo_exists(self) -> StackSettings:
        if self.image.repository not in self.registry.repositories:
            raise ValueError(
                f"image.repository {self.image.repository!r} is not one of "
                f"registry.repositories {self.registry.repositories}"
            )
        return self


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge a stack's pool overrides onto the defaults, so a stack states only changes."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class SettingsError(ValueError):
    """A stack setting is wrong; the message is one line naming the key."""


def parse_settings(raw: Mapping[str, Any]) -> StackSettings:
    """Validate the `raylift:*` stack config (already decoded from YAML/JSON).

    Raises SettingsError with one line per problem, each prefixed with the `raylift:` key path,
    so `pulumi preview` tells the user exactly which line of their stack file to fix.
    """
    # The catalog first, outside validation: a broken catalog file is its own one-line error,
    # not a complaint about whichever pool happened to be validated first.
    load_catalog()
    data = dict(raw)
    overrides = data.get("pools") or {}
    data["pools"] = _merge(_default_pools(), overrides)
    for key, pool in overrides.items():
        # A stack's deprecated `size` replaces the default maxNodes rather than clash with it.
        if isinstance(pool, Mapping) and "size" in pool and "maxNodes" not in pool:
            data["pools"][key].pop("maxNodes", None)
    try:
        return StackSettings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "(root)"
            lines.append(f"raylift:{where}: {err['msg']}")
        raise SettingsError("; ".join(lines)) from None
