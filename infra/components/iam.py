"""IAM: node roles scoped to this cluster's bucket, repositories, token and DNS zone.

Least privilege matters here because every Ray worker runs user code: whatever the role allows,
a training script (or an attacker who reached the Jobs API) can do. So the roles name concrete
ARNs; the only `*` resource is ecr:GetAuthorizationToken, which AWS defines without resource-
level permissions (it must be granted on "*"; it only returns a registry login, and the pull
actions that use it are still scoped to our repositories). SSM access comes from the AWS-managed
AmazonSSMManagedInstanceCore policy, which is the documented minimum for Session Manager.

The head gets one extra statement (upsert its own A record in the cluster's private zone);
workers don't, so a compromised worker cannot redirect the cluster to a fake head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

SSM_CORE_POLICY_ARN = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"

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


def node_policy_document(
    bucket_arn: str, repository_arns: Sequence[str], token_secret_arn: str | None
) -> dict:
    """The statements every node needs: its bucket, its images, its token."""
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
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
                "s3:ListMultipartUploadParts",
            ],
            "Resource": [f"{bucket_arn}/*"],
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


@dataclass(frozen=True)
class NodeIamArgs:
    cluster_name: str
    bucket_arn: pulumi.Input[str]
    repository_arns: Mapping[str, pulumi.Input[str]]
    token_secret_arn: pulumi.Input[str] | None
    zone_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


class NodeIam(pulumi.ComponentResource):
    """Two roles + instance profiles: `head` (nodes + DNS) and `worker` (nodes only)."""

    head_profile_arn: pulumi.Output[str]
    worker_profile_arn: pulumi.Output[str]

    def __init__(
        self, name: str, args: NodeIamArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:NodeIam", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        node_doc = pulumi.Output.all(
            args.bucket_arn, list(args.repository_arns.values()), args.token_secret_arn
        ).apply(lambda v: json.dumps(node_policy_document(v[0], v[1], v[2])))

        profiles: dict[str, pulumi.Output[str]] = {}
        for role_name in ("head", "worker"):
            role = aws.iam.Role(
                f"{name}-{role_name}",
                name_prefix=f"{args.cluster_name}-{role_name}-"[:38],
                assume_role_policy=_ASSUME_EC2,
                description=f"Raylift {args.cluster_name} {role_name} nodes",
                tags=args.tags,
                opts=child,
            )
            aws.iam.RolePolicyAttachment(
                f"{name}-{role_name}-ssm",
                role=role.name,
                policy_arn=SSM_CORE_POLICY_ARN,
                opts=child,
            )
            aws.iam.RolePolicy(
                f"{name}-{role_name}-node", role=role.id, policy=node_doc, opts=child
            )
            if role_name == "head":
                aws.iam.RolePolicy(
                    f"{name}-head-dns",
                    role=role.id,
                    policy=pulumi.Output.from_input(args.zone_id).apply(
                        lambda z: json.dumps(head_dns_policy_document(z))
                    ),
                    opts=child,
                )
            profile = aws.iam.InstanceProfile(
                f"{name}-{role_name}",
                name_prefix=f"{args.cluster_name}-{role_name}-"[:38],
                role=role.name,
                tags=args.tags,
                opts=child,
            )
            profiles[role_name] = profile.arn
        self.head_profile_arn = profiles["head"]
        self.worker_profile_arn = profiles["worker"]
        self.register_outputs(
            {"headProfileArn": profiles["head"], "workerProfileArn": profiles["worker"]}
        )
