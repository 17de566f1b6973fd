"""The stack's AMI: resolved once from AWS's public SSM parameter, then recorded.

EC2 can resolve `resolve:ssm:` names at every launch, but then a replacement node launched the
week after AWS publishes a new Deep Learning AMI gets a different NVIDIA driver from the rest of
its cluster. Instead the program reads the parameter and records the answer in an SSM parameter
of the cluster's own whose value is never updated by Pulumi (`ignore_changes`): every node,
now and later, boots that AMI. To move a cluster to a newer AMI on purpose:
`pulumi up --replace <urn of the <cluster>-ami parameter>`.
"""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import pulumi_aws as aws


def pinned_ami(
    cluster_name: str, public_parameter: str, tags: Mapping[str, str]
) -> pulumi.Output[str]:
    """The AMI id this stack recorded on its first `pulumi up` (the newest one at that time)."""
    latest = aws.ssm.get_parameter(name=public_parameter).value
    record = aws.ssm.Parameter(
        f"{cluster_name}-ami",
        name=f"/raylift/{cluster_name}/ami",
        type="String",
        value=latest,
        description=f"AMI pinned for Raylift cluster {cluster_name} (from {public_parameter})",
        tags=dict(tags),
        opts=pulumi.ResourceOptions(ignore_changes=["value"]),
    )
    return record.value
