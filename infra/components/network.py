"""Network: private subnets in several AZs, egress without public IPs, and a private DNS zone.

Nodes never get public IPs. They reach ECR/SSM/Secrets Manager through a NAT gateway or
interface endpoints, and S3 through a (free) gateway endpoint so checkpoint traffic does not
pay NAT per-GB charges. Subnets span several AZs because spot capacity is per AZ. The private
hosted zone gives the head a stable name (`head.<zone>`) that survives head replacement.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.settings import NetworkSettings


@dataclass(frozen=True)
class NetworkArgs:
    cluster_name: str
    region: str
    settings: NetworkSettings
    availability_zones: Sequence[str]
    tags: dict[str, str] = field(default_factory=dict)


def subnet_cidrs(vpc_cidr: str, count: int) -> tuple[list[str], list[str]]:
    """Private /19s from the bottom of the VPC, public /24s from its top /19.

    Private subnets are large because every Ray worker and every EFS mount target takes an IP;
    public subnets only hold NAT gateways.
    """
    net = ipaddress.ip_network(vpc_cidr)
    private = list(net.subnets(new_prefix=19))
    public = list(private[-1].subnets(new_prefix=24))
    return [str(s) for s in private[:count]], [str(s) for s in public[:count]]


class Network(pulumi.ComponentResource):
    """A VPC (or an existing one) with private subnets, egress and the cluster's DNS zone."""

    vpc_id: pulumi.Output[str]
    private_subnet_ids: list[pulumi.Output[str]]
    zone_id: pulumi.Output[str]
    zone_name: str
    # What a node's first boot needs from the network: egress (NAT, routes) and the DNS zone.
    boot_dependencies: list[pulumi.Resource]

    def __init__(
        self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        s = args.settings
        tags = args.tags
        self.zone_name = f"{args.cluster_name}.raylift.internal"
        self.private_route_table_ids: list[pulumi.Output[str]] = []
        self.boot_dependencies = []

        if s.existing_vpc_id is not None:
            assert s.existing_private_subnet_ids is not None  # enforced by NetworkSettings
            self.vpc_id = pulumi.Output.from_input(s.existing_vpc_id)
            self.private_subnet_ids = [
                pulumi.Output.from_input(i) for i in s.existing_private_subnet_ids
            ]
        else:
            self._create_vpc(name, args, child)

        # The S3 gateway endpoint needs route tables; with an existing VPC we don't own them.
        if self.private_route_table_ids:
            s3_endpoint = aws.ec2.VpcEndpoint(
                f"{name}-s3",
                vpc_id=self.vpc_id,
                service_name=f"com.amazonaws.{args.region}.s3",
                vpc_endpoint_type="Gateway",
                route_table_ids=self.private_route_table_ids,
                tags={**tags, "Name": f"{args.cluster_name}-s3"},
                opts=child,
            )
            self.boot_dependencies.append(s3_endpoint)

        zone = aws.route53.Zone(
            f"{name}-zone",
            name=self.zone_name,
            comment=f"Private names for Raylift cluster {args.cluster_name}",
            vpcs=[{"vpc_id": self.vpc_id}],
            force_destroy=True,  # the head's own A record must not block `pulumi destroy`
            tags=tags,
            opts=child,
        )
        self.zone_id = zone.zone_id
        self.zone_arn = zone.arn
        self.boot_dependencies.append(zone)
        self.register_outputs(
            {
                "vpcId": self.vpc_id,
                "privateSubnetIds": self.private_subnet_ids,
                "zoneId": self.zone_id,
                "zoneName": self.zone_name,
            }
        )

    def _create_vpc(self, name: str, args: NetworkArgs, child: pulumi.ResourceOptions) -> None:
        s = args.settings
        tags = args.tags
        azs = list(args.availability_zones)
        private_cidrs, public_cidrs = subnet_cidrs(s.vpc_cidr, len(azs))
        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=s.vpc_cidr,
            enable_dns_hostnames=True,  # needed by interface endpoints and EFS DNS names
            enable_dns_support=True,
            tags={**tags, "Name": args.cluster_name},
            opts=child,
        )
        self.vpc_id = vpc.id

        nat_ids: list[pulumi.Output[str]] = []
        igw = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=vpc.id, tags={**tags, "Name": args.cluster_name}, opts=child
        )
        public_rt = aws.ec2.RouteTable(
            f"{name}-public",
            vpc_id=vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}],
            tags={**tags, "Name": f"{args.cluster_name}-public"},
            opts=child,
        )
        nat_azs = azs if s.nat_gateway == "per-az" else azs[:1]
        for i, az in enumerate(nat_azs):
            public = aws.ec2.Subnet(
                f"{name}-public-{az}",
                vpc_id=vpc.id,
                cidr_block=public_cidrs[i],
                availability_zone=az,
                map_public_ip_on_launch=False,  # only the NAT's EIP is public
                tags={**tags, "Name": f"{args.cluster_name}-public-{az}"},
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-public-{az}",
                subnet_id=public.id,
                route_table_id=public_rt.id,
                opts=child,
            )
            eip = aws.ec2.Eip(f"{name}-nat-{az}", domain="vpc", tags=tags, opts=child)
            nat = aws.ec2.NatGateway(
                f"{name}-nat-{az}",
                allocation_id=eip.id,
                subnet_id=public.id,
                tags={**tags, "Name": f"{args.cluster_name}-{az}"},
                opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]),
            )
            nat_ids.append(nat.id)
            self.boot_dependencies.append(nat)

        self.private_subnet_ids = []
        for i, az in enumerate(azs):
            subnet = aws.ec2.Subnet(
                f"{name}-private-{az}",
                vpc_id=vpc.id,
                cidr_block=private_cidrs[i],
                availability_zone=az,
                map_public_ip_on_launch=False,
                tags={**tags, "Name": f"{args.cluster_name}-private-{az}"},
                opts=child,
            )
            # Egress through the NAT in this AZ (per-az) or the single shared NAT.
            routes = [{"cidr_block": "0.0.0.0/0", "nat_gateway_id": nat_ids[i % len(nat_ids)]}]
            rt = aws.ec2.RouteTable(
                f"{name}-private-{az}",
                vpc_id=vpc.id,
                routes=routes,
                tags={**tags, "Name": f"{args.cluster_name}-private-{az}"},
                opts=child,
            )
            association = aws.ec2.RouteTableAssociation(
                f"{name}-private-{az}", subnet_id=subnet.id, route_table_id=rt.id, opts=child
            )
            self.boot_dependencies += [rt, association]
            self.private_subnet_ids.append(subnet.id)
            self.private_route_table_ids.append(rt.id)


@dataclass(frozen=True)
class EndpointsArgs:
    region: str
    vpc_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]
    security_group_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


# What a node calls at boot: ECR (login + pull), SSM (Session Manager), Secrets Manager (the Ray
# token), STS (credential exchange). Route53 has no endpoint; the head reaches it via the NAT.
INTERFACE_SERVICES = (
    "ecr.api",
    "ecr.dkr",
    "ssm",
    "ssmmessages",
    "ec2messages",
    "secretsmanager",
    "sts",
)


class InterfaceEndpoints(pulumi.ComponentResource):
    """Private interface endpoints, so nodes reach AWS APIs without a NAT (optional, costs $)."""

    def __init__(
        self, name: str, args: EndpointsArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:InterfaceEndpoints", name, None, opts)
        ids = {}
        for service in INTERFACE_SERVICES:
            ep = aws.ec2.VpcEndpoint(
                f"{name}-{service.replace('.', '-')}",
                vpc_id=args.vpc_id,
                service_name=f"com.amazonaws.{args.region}.{service}",
                vpc_endpoint_type="Interface",
                private_dns_enabled=True,
                subnet_ids=list(args.subnet_ids),
                security_group_ids=[args.security_group_id],
                tags=args.tags,
                opts=pulumi.ResourceOptions(parent=self),
            )
            ids[service] = ep.id
        self.register_outputs({"endpointIds": ids})
