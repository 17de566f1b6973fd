"""IAM: node roles scoped to this cluster's bucket, repositories, token and DNS zone.

Least privilege matters here because every Ray worker runs user code: whatever the role allows,
a training script (or an attacker who reached the Jobs API) can do. So the roles name concrete
ARNs. `*` resources are used only where AWS defines no resource-level permission:
ecr:GetAuthorizationToken (it only returns a registry login; the pulls that use it are scoped to
our repositories) and the Session Manager agent's channel actions. The AWS-managed
AmazonSSMManagedInstanceCore policy is deliberately not attached: it also grants
ssm:GetParameter(s) on every parameter in the account, which every job's code would inherit.

Deletes are limited to what the trainer prunes (checkpoint folders `step_*` and its write probes
under the checkpoint prefix); a job cannot empty the bucket. A customer-managed KMS key gets
exactly the two calls SSE-KMS needs. Each node may mark itself unhealthy and complete or extend
the drain lifecycle hook on this cluster's Auto Scaling groups (by name and by tag), nothing more.

The head gets one extra statement (upsert its own A record in the cluster's private zone);
workers don't, so a compromised worker cannot redirect the cluster to a fake head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

# What the SSM agent needs for Session Manager and Run Command, and nothing that reads data:
# ssm:UpdateInstanceInformation registers the node; ssmmessages/ec2messages carry the session.
SESSION_MANAGER_ACTIONS = [
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
]
# A node's own Auto Scaling calls: give up on a failed boot, and the drain hook's handshake.
AUTOSCALING_SELF_ACTIONS = [
    "autoscaling:SetInstanceHealth",
    "autoscaling:CompleteLifecycleAction",
    "autoscaling:RecordLifecycleActionHeartbeat",
]

_ASSUME_EC2 = json.dumps(
    {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": "ec2.amazonaws.com"},
                "Action": "sts:AssumeRole",
            }
        ],
    }
)


@dataclass(frozen=True)
class NodeScope:
    """Plain values (no Outputs) the node policy is written from."""

    cluster_name: str
    region: str
    account_id: str
    checkpoint_prefix: str
    kms_key_arn: str | None = None


def prune_resources(bucket_arn: str, checkpoint_prefix: str) -> list[str]:
    """Object ARNs the trainer deletes: checkpoint folders it prunes (trainer/checkpoint/manager.py
    `prune`: `<run>/step_<N>/...`) and its storage write probes, under the checkpoint prefix."""
    prefix = checkpoint_prefix.lstrip("/")
    return [
        f"{bucket_arn}/{prefix}*/step_*",
        f"{bucket_arn}/{prefix}*.raylift-write-probe-*",
    ]


def autoscaling_group_arn(scope: NodeScope) -> str:
    """Every ASG of this cluster (their names all start with `<cluster>-`)."""
    return (
        f"arn:aws:autoscaling:{scope.region}:{scope.account_id}:autoScalingGroup:*:"
        f"autoScalingGroupName/{scope.cluster_name}-*"
    )


def cluster_groups_statement(sid: str, actions: Sequence[str], scope: NodeScope) -> dict:
    """Auto Scaling actions on this cluster's groups only (tagged raylift:cluster)."""
    return {
        "Sid": sid,
        "Effect": "Allow",
        "Action": list(actions),
        "Resource": [autoscaling_group_arn(scope)],
        "Condition": {
            "StringEquals": {"autoscaling:ResourceTag/raylift:cluster": scope.cluster_name}
        },
    }


def node_policy_document(
    bucket_arn: str,
    repository_arns: Sequence[str],
    token_secret_arn: str | None,
    scope: NodeScope,
) -> dict:
    """The statements every node needs: its bucket, its images, its token, its ASG, SSM."""
    statements: list[dict] = [
        {
            "Sid": "BucketList",
            "Effect": "Allow",
            "Action": ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"],
            "Resource": [bucket_arn],
        },
        {
            "Sid": "BucketObjects",
            "Effect": "Allow",
            "Action": [
                "s3:GetObject",
                "s3:PutObject",
                "s3:AbortMultipartUpload",
                "s3:ListMultipartUploadParts",
            ],
            "Resource": [f"{bucket_arn}/*"],
        },
        {
            "Sid": "BucketPrune",
            "Effect": "Allow",
            "Action": ["s3:DeleteObject"],
            "Resource": prune_resources(bucket_arn, scope.checkpoint_prefix),
        },
        {
            "Sid": "EcrLogin",
            "Effect": "Allow",
            # AWS defines no resource-level permission for this action: "*" is required.
            "Action": ["ecr:GetAuthorizationToken"],
            "Resource": "*",
        },
        {
            "Sid": "EcrPull",
            "Effect": "Allow",
            "Action": [
                "ecr:BatchGetImage",
                "ecr:GetDownloadUrlForLayer",
                "ecr:BatchCheckLayerAvailability",
            ],
            "Resource": sorted(repository_arns),
        },
    ]
    statements.append(
        cluster_groups_statement("OwnAutoScalingGroup", AUTOSCALING_SELF_ACTIONS, scope)
    )
    statements.append(
        {
            "Sid": "SessionManager",
            "Effect": "Allow",
            # AWS defines no resource-level permissions for the message channels.
            "Action": list(SESSION_MANAGER_ACTIONS),
            "Resource": "*",
        }
    )
    if scope.kms_key_arn:
        statements.append(
            {
                "Sid": "BucketKey",
                "Effect": "Allow",
                # SSE-KMS: GenerateDataKey to write an object, Decrypt to read one.
                "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
                "Resource": [scope.kms_key_arn],
            }
        )
    if token_secret_arn:
        statements.append(
            {
                "Sid": "RayToken",
                "Effect": "Allow",
                "Action": ["secretsmanager:GetSecretValue"],
                "Resource": [token_secret_arn],
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def head_dns_policy_document(zone_id: str) -> dict:
    """The head may change records in the cluster's private zone and nothing else."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "HeadRecord",
                "Effect": "Allow",
                "Action": ["route53:ChangeResourceRecordSets"],
                "Resource": [f"arn:aws:route53:::hostedzone/{zone_id}"],
            }
        ],
    }


# Ray's autoscaler on the head (trainer/autoscaling/provider.py): read the groups, size them,
# end one of their instances. The reads have no resource-level permissions.
AUTOSCALER_READ_ACTIONS = [
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeScalingActivities",
    "ec2:DescribeInstances",
]
AUTOSCALER_WRITE_ACTIONS = [
    "autoscaling:SetDesiredCapacity",
    "autoscaling:TerminateInstanceInAutoScalingGroup",
]


def head_autoscaler_policy_document(scope: NodeScope) -> dict:
    """The head sizes this cluster's groups (tagged raylift:cluster) and no other."""
    read = {
        "Sid": "AutoscalerRead",
        "Effect": "Allow",
        "Action": list(AUTOSCALER_READ_ACTIONS),
        "Resource": "*",
    }
    size = cluster_groups_statement("AutoscalerSize", AUTOSCALER_WRITE_ACTIONS, scope)
    return {"Version": "2012-10-17", "Statement": [read, size]}


@dataclass(frozen=True)
class NodeIamArgs:
    cluster_name: str
    bucket_arn: pulumi.Input[str]
    repository_arns: Mapping[str, pulumi.Input[str]]
    token_secret_arn: pulumi.Input[str] | None
    zone_id: pulumi.Input[str]
    scope: NodeScope
    tags: dict[str, str] = field(default_factory=dict)
    # The head runs Ray's autoscaler over the pools (raylift:autoscaling.enabled).
    autoscaling: bool = True


class NodeIam(pulumi.ComponentResource):
    """Two roles + instance profiles: `head` (nodes + DNS) and `worker` (nodes only)."""

    head_profile_arn: pulumi.Output[str]
    worker_profile_arn: pulumi.Output[str]
    # Everything a node's permissions consist of: pools wait for these before any instance
    # boots, so the first boot never races IAM.
    boot_dependencies: list[pulumi.Resource]

    def __init__(
        self, name: str, args: NodeIamArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:NodeIam", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        node_doc = pulumi.Output.all(
            args.bucket_arn, list(args.repository_arns.values()), args.token_secret_arn
        ).apply(lambda v: json.dumps(node_policy_document(v[0], v[1], v[2], args.scope)))

        profiles: dict[str, pulumi.Output[str]] = {}
        self.boot_dependencies = []
        for role_name in ("head", "worker"):
            role = aws.iam.Role(
                f"{name}-{role_name}",
                name_prefix=f"{args.cluster_name}-{role_name}-"[:38],
                assume_role_policy=_ASSUME_EC2,
                description=f"Raylift {args.cluster_name} {role_name} nodes",
                tags=args.tags,
                opts=child,
            )
            node_policy = aws.iam.RolePolicy(
                f"{name}-{role_name}-node", role=role.id, policy=node_doc, opts=child
            )
            self.boot_dependencies.append(node_policy)
            if role_name == "head":
                dns_policy = aws.iam.RolePolicy(
                    f"{name}-head-dns",
                    role=role.id,
                    policy=pulumi.Output.from_input(args.zone_id).apply(
                        lambda z: json.dumps(head_dns_policy_document(z))
                    ),
                    opts=child,
                )
                self.boot_dependencies.append(dns_policy)
                if args.autoscaling:
                    self.boot_dependencies.append(
                        aws.iam.RolePolicy(
                            f"{name}-head-autoscaler",
                            role=role.id,
                            policy=json.dumps(head_autoscaler_policy_document(args.scope)),
                            opts=child,
                        )
                    )
            profile = aws.iam.InstanceProfile(
                f"{name}-{role_name}",
                name_prefix=f"{args.cluster_name}-{role_name}-"[:38],
                role=role.name,
                tags=args.tags,
                opts=child,
            )
            profiles[role_name] = profile.arn
            self.boot_dependencies.append(profile)
        self.head_profile_arn = profiles["head"]
        self.worker_profile_arn = profiles["worker"]
        self.register_outputs(
            {"headProfileArn": profiles["head"], "workerProfileArn": profiles["worker"]}
        )
