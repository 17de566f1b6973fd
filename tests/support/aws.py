"""An AWS API emulator (moto's server) on 127.0.0.1, and a cluster's pools inside it.

moto speaks boto3's wire protocol, so the node provider is tested through the same client
calls it makes against AWS. What moto does not do (and the tests do not rely on): mark an
instance as spot, run out of capacity, fire lifecycle hooks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3

REGION = "us-east-1"
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(timeout: float = 60.0) -> Iterator[str]:
    """Start moto's server on a free loopback port; yield its endpoint URL."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", HOST, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url + "/moto-api/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on {url} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def aws_env() -> dict[str, str]:
    """Fake credentials: nothing may reach a real account."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def clients(endpoint: str) -> tuple[object, object]:
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    )
    return (
        session.client("autoscaling", endpoint_url=endpoint),
        session.client("ec2", endpoint_url=endpoint),
    )


@functools.cache
def _network(endpoint: str) -> tuple[str, str]:
    """One subnet and AMI per emulator (moto lists its AMIs slowly)."""
    _, ec2 = clients(endpoint)
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.0.0/19")["Subnet"]["SubnetId"]
    return subnet, ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def make_pools(
    endpoint: str,
    cluster: str,
    pools: dict[str, dict],
) -> dict[str, str]:
    """One launch template + ASG per pool, shaped as infra/components/pool.py makes them
    (tags, min/max, scale-in protection, a mixed-instances policy for spot). `pools` maps a
    pool name to {"min", "max", "desired", "role", "market", "types"}. Returns pool -> ASG name.
    """
    asg, ec2 = clients(endpoint)
    subnet, ami = _network(endpoint)
    names = {}
    for pool, spec in pools.items():
        types = spec.get("types", ["g5.4xlarge"])
        lt = ec2.create_launch_template(
            LaunchTemplateName=f"{cluster}-{pool}",
            LaunchTemplateData={"ImageId": ami, "InstanceType": types[0]},
        )["LaunchTemplate"]["LaunchTemplateId"]
        name = f"{cluster}-{pool}-asg"
        tags = {
            "raylift:cluster": cluster,
            "raylift:pool": pool,
            "raylift:role": spec.get("role", "worker"),
            "raylift:market": spec.get("market", "on-demand"),
        }
        args: dict = {
            "AutoScalingGroupName": name,
            "MinSize": spec.get("min", 0),
            "MaxSize": spec["max"],
            "DesiredCapacity": spec.get("desired", spec.get("min", 0)),
            "VPCZoneIdentifier": subnet,
            "NewInstancesProtectedFromScaleIn": True,
            "Tags": [
                {
                    "Key": k,
                    "Value": v,
                    "PropagateAtLaunch": True,
                    "ResourceId": name,
                    "ResourceType": "auto-scaling-group",
                }
                for k, v in tags.items()
            ],
        }
        if tags["raylift:market"] == "spot":
            args["MixedInstancesPolicy"] = {
                "LaunchTemplate": {
                    "LaunchTemplateSpecification": {"LaunchTemplateId": lt, "Version": "$Latest"},
                    "Overrides": [{"InstanceType": t} for t in types],
                },
                "InstancesDistribution": {
                    "OnDemandBaseCapacity": 0,
                    "OnDemandPercentageAboveBaseCapacity": 0,
                    "SpotAllocationStrategy": "price-capacity-optimized",
                },
            }
        else:
            args["LaunchTemplate"] = {"LaunchTemplateId": lt, "Version": "$Latest"}
        asg.create_auto_scaling_group(**args)
        names[pool] = name
    return names


def group(endpoint: str, name: str) -> dict:
    asg, _ = clients(endpoint)
    return asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]


def live_instances(endpoint: str, name: str) -> list[str]:
    return sorted(
        i["InstanceId"]
        for i in group(endpoint, name)["Instances"]
        if not i["LifecycleState"].startswith(("Terminating", "Terminated"))
    )
