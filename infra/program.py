"""The Pulumi program: read the stack config, compose the components, export the outputs.

Kept out of `__main__.py` so tests can run it under `pulumi.runtime.set_mocks` as a function.
Nothing here makes resources directly; each concern lives in one component under components/.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws
import yaml

from infra.autoscaler import (
    autoscaler_config,
    autoscaler_env,
    pool_labels,
    pool_resources,
)
from infra.catalog import CatalogError, load_catalog
from infra.checks import check_image_in_ecr, report_quotas
from infra.components.alerts import CapacityAlerts
from infra.components.ami import pinned_ami
from infra.components.iam import NodeIam, NodeIamArgs, NodeScope
from infra.components.network import EndpointsArgs, InterfaceEndpoints, Network, NetworkArgs
from infra.components.pool import DRAIN_HOOK, PoolArgs, RayPool
from infra.components.registry import Registry, RegistryArgs
from infra.components.secrets import RayToken, RayTokenArgs
from infra.components.security import ClusterSecurity, SecurityArgs
from infra.components.storage import Storage, StorageArgs
from infra.components.userdata import NodeBootstrap, render_user_data
from infra.image_tags import ImageTags, resolve_tags
from infra.settings import POOL_MARKETS, SettingsError, StackSettings, parse_settings
from infra.summary import pool_summary

# Top-level `raylift:` keys a stack file may set (see Pulumi.example.yaml).
_OBJECT_KEYS = ("network", "storage", "registry", "image", "ray", "autoscaling", "pools")


def read_settings() -> StackSettings:
    """Collect the `raylift:*` stack config into one validated settings object."""
    cfg = pulumi.Config("raylift")
    raw: dict[str, Any] = {}
    for key in ("clusterName", "amiParameter", "alertEmail"):
        value = cfg.get(key)
        if value is not None:
            raw[key] = value
    for key in _OBJECT_KEYS:
        value = cfg.get_object(key)
        if value is not None:
            raw[key] = value
    try:
        return parse_settings(raw)
    except (CatalogError, SettingsError) as exc:
        # RunError: the CLI prints the message alone, one line, no Python traceback.
        raise pulumi.RunError(str(exc)) from None


def main() -> dict[str, Any]:
    """Build the stack. Returns the exported outputs (tests read them under mocks)."""
    settings = read_settings()
    region = pulumi.Config("aws").require("region")
    name = settings.cluster_name
    tags = {"raylift:cluster": name, "managed-by": "pulumi"}

    net_settings = settings.network
    if net_settings.existing_vpc_id is not None:
        azs: list[str] = []
    elif net_settings.availability_zones:
        azs = list(net_settings.availability_zones)
    else:
        azs = aws.get_availability_zones(state="available").names[: net_settings.az_count]

    network = Network(
        name,
        NetworkArgs(
            cluster_name=name,
            region=region,
            settings=net_settings,
            availability_zones=azs,
            tags=tags,
        ),
    )
    security = ClusterSecurity(
        name, SecurityArgs(cluster_name=name, vpc_id=network.vpc_id, ray=settings.ray, tags=tags)
    )
    endpoints = None
    if net_settings.interface_endpoints:
        endpoints = InterfaceEndpoints(
            f"{name}-endpoints",
            EndpointsArgs(
                region=region,
                vpc_id=network.vpc_id,
                subnet_ids=network.private_subnet_ids,
                security_group_id=security.endpoint_sg_id,
                tags=tags,
            ),
        )
    storage = Storage(
        name,
        StorageArgs(
            cluster_name=name,
            settings=settings.storage,
            subnet_ids=network.private_subnet_ids,
            efs_security_group_id=security.efs_sg_id,
            tags=tags,
        ),
    )
    registry = Registry(name, RegistryArgs(settings=settings.registry, tags=tags))
    token = (
        RayToken(name, RayTokenArgs(cluster_name=name, tags=tags))
        if settings.ray.token_auth
        else None
    )
    iam = NodeIam(
        name,
        NodeIamArgs(
            cluster_name=name,
            bucket_arn=storage.bucket_arn,
            repository_arns=registry.repository_arns,
            token_secret_arn=token.secret_arn if token else None,
            zone_id=network.zone_id,
            scope=NodeScope(
                cluster_name=name,
                region=region,
                account_id=aws.get_caller_identity().account_id,
                checkpoint_prefix=settings.storage.checkpoint_prefix,
                kms_key_arn=settings.storage.kms_key_arn,
            ),
            tags=tags,
            autoscaling=settings.autoscaling.enabled,
        ),
    )

    head_fqdn = f"head.{network.zone_name}"
    repo_url = registry.repository_urls[settings.image.repository]
    repo_name = f"{settings.registry.prefix}/{settings.image.repository}"
    image_tags = resolve_tags(settings.image)
    enabled = {p: spec for p, spec in settings.pools.by_name().items() if spec.capacity > 0}
    if image_tags is None:
        pulumi.log.warn(
            "no image tag (raylift:image.tag unset and no "
            f"{settings.image.tag_file} yet): created the network, storage and ECR "
            "repositories but no node pools. Next: `make image push` (it writes the tag "
            "file), then `pulumi up` again."
        )
        enabled = {}
    else:
        check_image_in_ecr(repo_name, image_tags.gpu, image_tags.source)
        if "cpu" in enabled:
            if image_tags.cpu is None:
                raise pulumi.RunError(
                    f"raylift:image.cpuTag: the cpu pool needs the trainer-cpu tag, and "
                    f"{image_tags.gpu!r} is not a trainer-gpu-... tag to derive it from; set it"
                )
            check_image_in_ecr(repo_name, image_tags.cpu, f"{image_tags.source}, cpu variant")
        report_quotas(settings)
    for line in settings.pools.deprecations():
        pulumi.log.warn(line)
    autoscaling = settings.autoscaling.enabled
    head_autoscaler = (
        (
            yaml.safe_dump(autoscaler_config(settings, region), sort_keys=False),
            autoscaler_env(settings),
        )
        if autoscaling
        else (None, {})
    )
    alerts = CapacityAlerts(name, settings.alert_email, tags)
    stack_ami = pinned_ami(name, settings.ami_parameter, tags) if enabled else None
    boot_dependencies = [
        *network.boot_dependencies,
        *storage.boot_dependencies,
        *iam.boot_dependencies,
        *(token.boot_dependencies if token else []),
        *([endpoints] if endpoints is not None else []),
    ]
    pools: dict[str, RayPool] = {}
    for pool, spec in enabled.items():
        assert isinstance(image_tags, ImageTags)
        role = "head" if pool == "head" else "worker"
        instance = load_catalog().instances[spec.instance_types[0]]
        use_gpus = instance.gpu_count > 0
        # The CPU pool runs the oneCCL build of the trainer image; everything else the GPU one.
        tag = image_tags.cpu if pool == "cpu" else image_tags.gpu
        user_data = pulumi.Output.all(
            efs_id=storage.efs_id,
            repo_url=repo_url,
            secret_arn=token.secret_arn if token else None,
            zone_id=network.zone_id,
        ).apply(
            lambda v, pool=pool, spec=spec, role=role, use_gpus=use_gpus, tag=tag: render_user_data(
                NodeBootstrap(
                    role=role,
                    pool=pool,
                    market=POOL_MARKETS[pool],
                    cluster_name=name,
                    region=region,
                    efs_id=v["efs_id"],
                    mount_path=settings.storage.mount_path,
                    image=f"{v['repo_url']}:{tag}",
                    head_fqdn=head_fqdn,
                    ray=settings.ray,
                    use_gpus=use_gpus,
                    labels=pool_labels(pool, spec.labels),
                    resources=pool_resources(pool, spec.resources),
                    num_cpus=spec.num_cpus,
                    token_secret_arn=v["secret_arn"],
                    hosted_zone_id=v["zone_id"] if role == "head" else None,
                    lifecycle_hook=DRAIN_HOOK if role == "worker" else None,
                    autoscaler_config=head_autoscaler[0] if role == "head" else None,
                    autoscaler_env=head_autoscaler[1] if role == "head" else {},
                )
            )
        )
        pools[pool] = RayPool(
            f"{name}-{pool}",
            PoolArgs(
                cluster_name=name,
                pool=pool,
                role=role,
                market=POOL_MARKETS[pool],
                instance_types=spec.instance_types,
                size=spec.capacity,
                min_size=spec.min_nodes if autoscaling and role == "worker" else None,
                root_volume_gib=spec.root_volume_gib,
                root_volume_throughput=spec.root_volume_throughput,
                root_volume_iops=spec.root_volume_iops,
                root_device_name=spec.root_device_name,
                ami=spec.ami or stack_ami,
                subnet_ids=network.private_subnet_ids,
                security_group_id=security.cluster_sg_id,
                instance_profile_arn=(
                    iam.head_profile_arn if role == "head" else iam.worker_profile_arn
                ),
                user_data=user_data,
                alerts_topic_arn=alerts.topic_arn,
                boot_dependencies=boot_dependencies,
                tags=tags,
            ),
        )

    dashboard = settings.ray.dashboard_port
    ports = f'{{"portNumber":["{dashboard}"],"localPortNumber":["{dashboard}"]}}'
    port_forward = None
    if "head" in pools:
        port_forward = pools["head"].asg_name.apply(
            lambda asg: (
                f'aws ssm start-session --region {region} --target "$(aws ec2 describe-instances '
                f"--region {region} --filters Name=tag:aws:autoscaling:groupName,Values={asg} "
                "Name=instance-state-name,Values=running "
                "--query 'Reservations[0].Instances[0].InstanceId' --output text)\" "
                "--document-name AWS-StartPortForwardingSession "
                f"--parameters '{ports}'"
            )
        )
    summary = pool_summary(settings)
    outputs: dict[str, Any] = {
        "headAddress": f"{head_fqdn}:{settings.ray.gcs_port}",
        "jobsApiPortForward": port_forward,
        "jobsApiLocalAddress": f"http://127.0.0.1:{dashboard}",
        "bucket": storage.bucket_name,
        "efsId": storage.efs_id,
        "sharedMountPath": settings.storage.mount_path,
        "repositories": registry.repository_urls,
        "image": (repo_url.apply(lambda u, t=image_tags.gpu: f"{u}:{t}") if image_tags else None),
        "cpuImage": (
            repo_url.apply(lambda u, t=image_tags.cpu: f"{u}:{t}")
            if image_tags and image_tags.cpu
            else None
        ),
        "ami": stack_ami,
        "capacityAlertsTopic": alerts.topic_arn,
        "rayAuthTokenSecretArn": token.secret_arn if token else None,
        "summary": summary,
        # What the cluster bills while no job runs (the head alone, unless minNodes > 0).
        "idleUsdPerHour": summary["idleUsdPerHour"],
    }
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs
