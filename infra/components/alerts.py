"""Capacity alerts: an ASG that cannot launch (no capacity, a vCPU quota) must not be silent.

The groups don't make `pulumi up` wait for capacity (GPU capacity can take hours), so their
launch failures go to this SNS topic; subscribe to it (`alertEmail` does it for one address).
"""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import pulumi_aws as aws


class CapacityAlerts(pulumi.ComponentResource):
    topic_arn: pulumi.Output[str]

    def __init__(
        self,
        name: str,
        email: str | None,
        tags: Mapping[str, str],
        opts: pulumi.ResourceOptions | None = None,
    ) -> None:
        super().__init__("raylift:infra:CapacityAlerts", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        topic = aws.sns.Topic(
            f"{name}-capacity",
            name_prefix=f"{name}-capacity-",
            tags=dict(tags),
            opts=child,
        )
        if email:
            aws.sns.TopicSubscription(
                f"{name}-capacity-email",
                topic=topic.arn,
                protocol="email",
                endpoint=email,
                opts=child,
            )
        self.topic_arn = topic.arn
        self.register_outputs({"topicArn": topic.arn})
