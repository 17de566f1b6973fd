"""Storage: the S3 bucket for checkpoints/weights and the EFS shared directory.

S3 holds what must outlive the cluster (HF-format checkpoints, model weights); EFS is the
ReadWriteMany disk every node mounts at the same path, so a replacement spot node or a new
head sees the same checkpoints and data. Both are private and encrypted; the bucket also
refuses plain-HTTP requests and cleans up old checkpoints and torn multipart uploads (a crash
mid-upload otherwise leaves invisible parts that are billed forever).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.settings import StorageSettings


@dataclass(frozen=True)
class StorageArgs:
    cluster_name: str
    settings: StorageSettings
    subnet_ids: Sequence[pulumi.Input[str]]
    efs_security_group_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


def deny_insecure_transport_policy(bucket_arn: str) -> str:
    """Bucket policy: refuse any request not made over TLS."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "DenyInsecureTransport",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "s3:*",
                    "Resource": [bucket_arn, f"{bucket_arn}/*"],
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                }
            ],
        }
    )


class Storage(pulumi.ComponentResource):
    """S3 bucket (private, SSE, lifecycle, optional versioning) and encrypted EFS."""

    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]
    efs_id: pulumi.Output[str]
    # The mount targets: a node that boots before its AZ's target exists cannot mount EFS.
    boot_dependencies: list[pulumi.Resource]

    def __init__(
        self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        s = args.settings
        tags = args.tags

        naming = {"bucket": s.bucket_name} if s.bucket_name else {}
        bucket = aws.s3.Bucket(
            f"{name}-bucket",
            force_destroy=s.force_destroy,
            tags=tags,
            opts=child,
            **naming,
        )
        aws.s3.BucketPublicAccessBlock(
            f"{name}-bucket",
            bucket=bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=child,
        )
        # ACLs off: access is decided by IAM and the bucket policy only.
        aws.s3.BucketOwnershipControls(
            f"{name}-bucket",
            bucket=bucket.id,
            rule={"object_ownership": "BucketOwnerEnforced"},
            opts=child,
        )
        sse: dict[str, str] = {"sse_algorithm": "aws:kms" if s.kms_key_arn else "AES256"}
        if s.kms_key_arn:
            sse["kms_master_key_id"] = s.kms_key_arn
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-bucket",
            bucket=bucket.id,
            rules=[
                {
                    "apply_server_side_encryption_by_default": sse,
                    # One KMS call per bucket key instead of per object: checkpoints are many
                    # shards, and per-object KMS requests get throttled and billed.
                    "bucket_key_enabled": bool(s.kms_key_arn),
                }
            ],
            opts=child,
        )
        versioning = aws.s3.BucketVersioning(
            f"{name}-bucket",
            bucket=bucket.id,
            versioning_configuration={"status": "Enabled" if s.versioning else "Suspended"},
            opts=child,
        )
        rules: list[dict] = [
            {
                "id": "abort-incomplete-multipart-uploads",
                "status": "Enabled",
                "filter": {"prefix": ""},
                "abort_incomplete_multipart_upload": {"days_after_initiation": 7},
            }
        ]
        if s.checkpoint_expiration_days:
            rules.append(
                {
                    "id": "expire-old-checkpoints",
                    "status": "Enabled",
                    "filter": {"prefix": s.checkpoint_prefix},
                    "expiration": {"days": s.checkpoint_expiration_days},
                }
            )
        if s.versioning:
            rules.append(
                {
                    "id": "expire-noncurrent-versions",
                    "status": "Enabled",
                    "filter": {"prefix": ""},
                    "noncurrent_version_expiration": {
                        "noncurrent_days": s.noncurrent_version_expiration_days
                    },
                }
            )
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-bucket",
            bucket=bucket.id,
            rules=rules,
            # AWS rejects lifecycle changes racing a versioning change on a new bucket.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[versioning]),
        )
        aws.s3.BucketPolicy(
            f"{name}-bucket",
            bucket=bucket.id,
            policy=bucket.arn.apply(deny_insecure_transport_policy),
            opts=child,
        )

        efs = aws.efs.FileSystem(
            f"{name}-efs",
            encrypted=True,
            kms_key_id=s.kms_key_arn,
            performance_mode="generalPurpose",
            throughput_mode=s.efs_throughput_mode,
            tags={**tags, "Name": f"{args.cluster_name}-shared"},
            opts=child,
        )
        # One mount target per subnet, so a node in any AZ mounts locally (no cross-AZ NFS).
        self.boot_dependencies = []
        for i, subnet_id in enumerate(args.subnet_ids):
            target = aws.efs.MountTarget(
                f"{name}-efs-{i}",
                file_system_id=efs.id,
                subnet_id=subnet_id,
                security_groups=[args.efs_security_group_id],
                opts=child,
            )
            self.boot_dependencies.append(target)

        self.bucket_name = bucket.bucket
        self.bucket_arn = bucket.arn
        self.efs_id = efs.id
        self.register_outputs(
            {"bucketName": bucket.bucket, "bucketArn": bucket.arn, "efsId": efs.id}
        )
