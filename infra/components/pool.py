"""A Ray node pool: one launch template + one Auto Scaling group.

Ray's autoscaler on the head decides how many nodes a worker pool holds (between minNodes and
maxNodes) through the group's desired capacity; the group decides which instances: AWS
replaces a dead or reclaimed node, and the node's systemd unit rejoins the cluster on its own.
So `pulumi up` never resets a running pool (it ignores desired capacity after creating the
group), and new instances are protected from scale-in: only the autoscaler, which knows which
node is idle, picks the node to end. The head, and every pool of a stack without autoscaling,
holds a fixed size (min = max = desired). Launch templates
require IMDSv2 (SSRF in a training script can't steal the role's credentials with a plain GET)
with hop limit 2 so the container, one network hop further, can still fetch credentials, and
encrypt the root volume that holds images and local checkpoint staging.

What the group must never do to a training cluster, and how it is kept from it:
- boot nodes before what they need exists: the ASG depends on every boot dependency (routes,
  NAT, mount targets, the token's value, the IAM policies), so the first boot never races them;
- end healthy nodes to even out AZs: AZRebalance is suspended;
- end a node on a mere rebalance recommendation: capacity rebalance is off (see infra/README.md);
- end a worker without warning: a termination lifecycle hook (DRAIN_HOOK) holds it in
  Terminating:Wait for up to DRAIN_TIMEOUT_S while the node agent drains Ray and completes it;
- keep a node whose boot failed: its bootstrap marks it unhealthy and shuts down, and the
  launch template's shutdown behaviour is `terminate`, so the group replaces it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import pulumi
import pulumi_aws as aws

from infra.settings import Market

# The termination hook the node agent completes (its name is in each node's /etc/raylift/node.env).
DRAIN_HOOK = "raylift-drain"
# How long a terminating worker waits for the agent: enough to checkpoint and drain; a spot
# interruption ends the instance after 120 s whatever the hook says.
DRAIN_TIMEOUT_S = 300
# Launch failures (no capacity in any listed type/AZ, vCPU quota exceeded) go to the alerts topic.
CAPACITY_NOTIFICATIONS = [
    "autoscaling:EC2_INSTANCE_LAUNCH_ERROR",
    "autoscaling:EC2_INSTANCE_TERMINATE_ERROR",
]


@dataclass(frozen=True)
class PoolArgs:
    cluster_name: str
    pool: str
    role: Literal["head", "worker"]
    market: Market
    instance_types: Sequence[str]
    size: int
    root_volume_gib: int
    root_volume_throughput: int
    root_volume_iops: int
    root_device_name: str
    ami: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]
    security_group_id: pulumi.Input[str]
    instance_profile_arn: pulumi.Input[str]
    user_data: pulumi.Input[str]
    alerts_topic_arn: pulumi.Input[str]
    # Resources that must exist before any instance of the pool boots.
    boot_dependencies: Sequence[pulumi.Resource] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    # Sized by Ray's autoscaler between min_size and `size` (its max); None: fixed at `size`.
    min_size: int | None = None

    @property
    def autoscaled(self) -> bool:
        return self.min_size is not None


def spot_instances_distribution() -> dict:
    """All-spot, price-capacity-optimized: AWS picks the deepest, cheapest pools across the
    listed types and AZs, which is what keeps reclaim rates low for multi-hour runs."""
    return {
        "on_demand_base_capacity": 0,
        "on_demand_percentage_above_base_capacity": 0,
        "spot_allocation_strategy": "price-capacity-optimized",
    }


class RayPool(pulumi.ComponentResource):
    """Launch template + ASG for one pool; spot pools use a mixed-instances policy."""

    asg_name: pulumi.Output[str]
    launch_template_id: pulumi.Output[str]

    def __init__(
        self, name: str, args: PoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:RayPool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        node_tags = {
            **args.tags,
            "Name": f"{args.cluster_name}-{args.pool}",
            "raylift:pool": args.pool,
            "raylift:market": args.market,
            "raylift:role": args.role,
        }
        spot = args.market == "spot"

        lt = aws.ec2.LaunchTemplate(
            f"{name}-lt",
            name_prefix=f"{args.cluster_name}-{args.pool}-",
            description=f"Raylift {args.cluster_name} {args.pool} ({args.role}, {args.market})",
            image_id=args.ami,
            # Spot pools pick the type in the ASG overrides; the first type is the fallback.
            instance_type=args.instance_types[0],
            iam_instance_profile={"arn": args.instance_profile_arn},
            vpc_security_group_ids=[args.security_group_id],
            # A node whose bootstrap gives up shuts itself down; terminate (not stop) it, so
            # the group launches a replacement instead of keeping a stopped instance.
            instance_initiated_shutdown_behavior="terminate",
            metadata_options={
                "http_endpoint": "enabled",
                "http_tokens": "required",
                "http_put_response_hop_limit": 2,
                "instance_metadata_tags": "enabled",
            },
            block_device_mappings=[
                {
                    "device_name": args.root_device_name,
                    "ebs": {
                        "volume_size": args.root_volume_gib,
                        "volume_type": "gp3",
                        "throughput": args.root_volume_throughput,
                        "iops": args.root_volume_iops,
                        "encrypted": "true",
                        "delete_on_termination": "true",
                    },
                }
            ],
            user_data=pulumi.Output.from_input(args.user_data).apply(
                lambda text: base64.b64encode(text.encode()).decode()
            ),
            tag_specifications=[{"resource_type": "volume", "tags": node_tags}],
            update_default_version=True,
            tags=args.tags,
            opts=child,
        )
        lt_spec = {"id": lt.id, "version": lt.latest_version.apply(str)}

        group_args: dict = {}
        if spot:
            group_args["mixed_instances_policy"] = {
                "instances_distribution": spot_instances_distribution(),
                "launch_template": {
                    "launch_template_specification": {
                        "launch_template_id": lt.id,
                        "version": lt.latest_version.apply(str),
                    },
                    "overrides": [{"instance_type": t} for t in args.instance_types],
                },
            }
        else:
            group_args["launch_template"] = lt_spec

        asg = aws.autoscaling.Group(
            f"{name}-asg",
            name_prefix=f"{args.cluster_name}-{args.pool}-",
            min_size=args.min_size if args.autoscaled else args.size,
            max_size=args.size,
            # Where the autoscaler starts; it owns the number from then on (ignore_changes).
            desired_capacity=args.min_size if args.autoscaled else args.size,
            protect_from_scale_in=args.autoscaled,
            vpc_zone_identifiers=list(args.subnet_ids),
            health_check_type="EC2",
            health_check_grace_period=600,
            # Don't make `pulumi up` wait for (possibly scarce) GPU capacity; the ASG keeps trying.
            wait_for_capacity_timeout="0",
            # A rebalance recommendation often never becomes an interruption, and ending a
            # worker restarts the whole training group: react to the real two-minute notice
            # (the node agent checkpoints and drains), not to the recommendation.
            capacity_rebalance=False,
            # AZRebalance would end healthy training nodes just to even out the AZs.
            suspended_processes=["AZRebalance"],
            tags=[
                {"key": k, "value": v, "propagate_at_launch": True}
                for k, v in sorted(node_tags.items())
            ],
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=list(args.boot_dependencies),
                ignore_changes=["desiredCapacity"] if args.autoscaled else None,
            ),
            **group_args,
        )
        if args.role == "worker":
            aws.autoscaling.LifecycleHook(
                f"{name}-drain",
                name=DRAIN_HOOK,
                autoscaling_group_name=asg.name,
                lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                heartbeat_timeout=DRAIN_TIMEOUT_S,
                # No agent (or a dead one) must not keep a node forever: terminate at timeout.
                default_result="CONTINUE",
                opts=child,
            )
        aws.autoscaling.Notification(
            f"{name}-capacity",
            group_names=[asg.name],
            notifications=CAPACITY_NOTIFICATIONS,
            topic_arn=args.alerts_topic_arn,
            opts=child,
        )
        self.asg_name = asg.name
        self.launch_template_id = lt.id
        self.register_outputs({"asgName": asg.name, "launchTemplateId": lt.id})
