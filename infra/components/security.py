"""Security groups: one cluster group whose Ray ports are reachable only from itself.

The Ray cluster launcher's AWS default opens SSH to 0.0.0.0/0, and an unauthenticated Ray
Jobs API on the network is remote code execution (the 2024 ShadowRay attacks). Here nothing is
reachable from outside the cluster: every ingress rule names a security group as its source,
never a CIDR, SSH is not opened at all (operators use SSM Session Manager, which needs only
outbound HTTPS), and Ray token auth is on as a second layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.settings import RaySettings


@dataclass(frozen=True)
class PortRule:
    """One ingress rule from the cluster group to itself."""

    key: str
    from_port: int
    to_port: int
    description: str


def ray_port_rules(ray: RaySettings) -> list[PortRule]:
    """Every port `ray start` binds (pinned in the user data) plus the collectives' range."""
    singles = {
        "gcs": (ray.gcs_port, "Ray GCS (head)"),
        "dashboard": (ray.dashboard_port, "Ray dashboard and Jobs API (head)"),
        "client": (ray.client_server_port, "Ray client server (head)"),
        "node-manager": (ray.node_manager_port, "raylet node manager"),
        "object-manager": (ray.object_manager_port, "object manager"),
        "runtime-env-agent": (ray.runtime_env_agent_port, "runtime env agent"),
        "agent-grpc": (ray.dashboard_agent_grpc_port, "dashboard agent gRPC"),
        "agent-http": (ray.dashboard_agent_listen_port, "dashboard agent HTTP"),
        "metrics": (ray.metrics_export_port, "Prometheus metrics export"),
    }
    rules = [PortRule(k, p, p, d) for k, (p, d) in singles.items()]
    rules.append(
        PortRule("workers", ray.min_worker_port, ray.max_worker_port, "Ray worker processes")
    )
    low, high = ray.collective_port_range
    rules.append(PortRule("collectives", low, high, "NCCL/gloo/oneCCL and torch TCPStore"))
    return rules


@dataclass(frozen=True)
class SecurityArgs:
    cluster_name: str
    vpc_id: pulumi.Input[str]
    ray: RaySettings
    tags: dict[str, str] = field(default_factory=dict)


class ClusterSecurity(pulumi.ComponentResource):
    """The cluster group (all nodes), the EFS group (NFS from nodes) and the endpoint group."""

    cluster_sg_id: pulumi.Output[str]
    efs_sg_id: pulumi.Output[str]
    endpoint_sg_id: pulumi.Output[str]

    def __init__(
        self, name: str, args: SecurityArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:ClusterSecurity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = args.tags

        # No inline ingress/egress blocks: standalone rule resources are AWS provider best
        # practice and let the policy pack and tests see each rule on its own.
        cluster = aws.ec2.SecurityGroup(
            f"{name}-cluster",
            vpc_id=args.vpc_id,
            description=f"Raylift {args.cluster_name}: Ray nodes; ingress only from itself",
            tags={**tags, "Name": f"{args.cluster_name}-cluster"},
            opts=child,
        )
        for rule in ray_port_rules(args.ray):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-ray-{rule.key}",
                security_group_id=cluster.id,
                referenced_security_group_id=cluster.id,
                ip_protocol="tcp",
                from_port=rule.from_port,
                to_port=rule.to_port,
                description=rule.description,
                opts=child,
            )
        # Nodes need outbound HTTPS to ECR, SSM, Secrets Manager, S3, Hugging Face and PyPI.
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress",
            security_group_id=cluster.id,
            cidr_ipv4="0.0.0.0/0",
            ip_protocol="-1",
            description="all outbound (NAT or endpoints); inbound stays closed",
            opts=child,
        )

        efs = aws.ec2.SecurityGroup(
            f"{name}-efs",
            vpc_id=args.vpc_id,
            description=f"Raylift {args.cluster_name}: EFS mount targets, NFS from nodes only",
            tags={**tags, "Name": f"{args.cluster_name}-efs"},
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-efs-nfs",
            security_group_id=efs.id,
            referenced_security_group_id=cluster.id,
            ip_protocol="tcp",
            from_port=2049,
            to_port=2049,
            description="NFS from Ray nodes",
            opts=child,
        )

        endpoints = aws.ec2.SecurityGroup(
            f"{name}-endpoints",
            vpc_id=args.vpc_id,
            description=f"Raylift {args.cluster_name}: VPC interface endpoints, HTTPS from nodes",
            tags={**tags, "Name": f"{args.cluster_name}-endpoints"},
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-endpoints-https",
            security_group_id=endpoints.id,
            referenced_security_group_id=cluster.id,
            ip_protocol="tcp",
            from_port=443,
            to_port=443,
            description="HTTPS from Ray nodes",
            opts=child,
        )

        self.cluster_sg_id = cluster.id
        self.efs_sg_id = efs.id
        self.endpoint_sg_id = endpoints.id
        self.register_outputs(
            {
                "clusterSecurityGroupId": cluster.id,
                "efsSecurityGroupId": efs.id,
                "endpointSecurityGroupId": endpoints.id,
            }
        )
