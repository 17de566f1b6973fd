"""The Pulumi program under mocks: assertions on the resource inputs AWS would receive."""

from __future__ import annotations

import json
from typing import Any

import pytest
from infra_stack import ASG, FULL_CONFIG, INFRA, LT, Stack, StackRunner, stack_file_config

from trainer.planner.catalog import get_instance

SG = "aws:ec2/securityGroup:SecurityGroup"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
BUCKET = "aws:s3/bucket:Bucket"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"

EXPECTED_FULL = {
    # pool: (market, instance types, size, labels, resources)
    "head": ("on-demand", ["m5.2xlarge"], 1, {"pool": "head", "market": "on-demand"}, {}),
    "gpu-ondemand": (
        "on-demand",
        ["g5.12xlarge"],
        2,
        {"pool": "gpu-ondemand", "market": "on-demand"},
        {},
    ),
    "gpu-spot": (
        "spot",
        ["g5.2xlarge", "g5.4xlarge", "g5.8xlarge"],
        5,
        {"pool": "gpu-spot", "market": "spot", "team": "research"},
        {},
    ),
    "large-cpu-mem": (
        "on-demand",
        ["g5.24xlarge"],
        1,
        {"pool": "large-cpu-mem", "market": "on-demand", "large_cpu_mem": "true"},
        {"large_cpu_mem": 1},
    ),
    "cpu": ("on-demand", ["c7i.16xlarge"], 3, {"pool": "cpu", "market": "on-demand"}, {"ccl": 1}),
}


@pytest.mark.parametrize("pool", sorted(EXPECTED_FULL))
def test_pool_types_market_size_labels_resources(full_stack: Stack, pool: str) -> None:
    market, types, size, labels, resources = EXPECTED_FULL[pool]
    p = full_stack.pools[pool]
    assert p.market == market
    assert p.instance_types == types
    assert p.size == size
    assert p.labels == labels
    assert p.resources == resources


def test_only_enabled_pools_exist(example_stack: Stack) -> None:
    # Pulumi.example.yaml: head, large-cpu-mem (1) and gpu-spot (3); gpu-ondemand and cpu are 0.
    assert {name: p.size for name, p in example_stack.pools.items()} == {
        "head": 1,
        "large-cpu-mem": 1,
        "gpu-spot": 3,
    }
    assert example_stack.pools["gpu-spot"].labels["team"] == "research"


def test_head_and_workers_ray_start(full_stack: Stack) -> None:
    head = full_stack.pools["head"].ray_start
    assert head["head"] is True
    assert head["port"] == "6379"
    assert head["dashboard-port"] == "8265"
    assert head["ray-client-server-port"] == "10001"
    assert head["num-cpus"] == "0"  # nothing trains on the head
    assert "address" not in head
    head_address = full_stack.outputs["headAddress"]
    assert head_address == "head.full.raylift.internal:6379"
    for name, pool in full_stack.pools.items():
        flags = pool.ray_start
        assert flags["block"] is True, name  # foreground, so systemd supervises Ray itself
        if name != "head":
            assert "head" not in flags
            assert flags["address"] == head_address


def test_gpu_flag_follows_catalog(full_stack: Stack) -> None:
    for name, pool in full_stack.pools.items():
        has_gpu = get_instance(pool.instance_types[0]).gpu_count > 0
        assert ("USE_GPUS=1\n" in pool.user_data) is has_gpu, name


def test_images_from_config(full_stack: Stack) -> None:
    repo = full_stack.outputs["repositories"]["trainer"]
    for name, pool in full_stack.pools.items():
        # The CPU pool runs the trainer-cpu image of the same version and commit.
        tag = "trainer-cpu-1.2.3-abcdef0" if name == "cpu" else "trainer-gpu-1.2.3-abcdef0"
        assert f"IMAGE='{repo}:{tag}'\n" in pool.user_data, name


def _systemd_unit(user_data: str) -> dict[str, str]:
    """The [Service]/[Unit] keys of the unit file the bootstrap writes (heredoc RAYLIFT_UNIT)."""
    body = user_data.split("<<'RAYLIFT_UNIT'\n", 1)[1].split("\nRAYLIFT_UNIT\n", 1)[0]
    pairs = [line.split("=", 1) for line in body.splitlines() if "=" in line]
    return {k: v for k, v in pairs}


def test_supervised_restart(full_stack: Stack) -> None:
    for name, pool in full_stack.pools.items():
        unit = _systemd_unit(pool.user_data)
        assert unit["Restart"] == "always", name
        assert unit["StartLimitIntervalSec"] == "0", name  # never give up on a dead head
        assert unit["ExecStart"] == "/usr/local/bin/raylift-ray", name
        assert "systemctl enable --now raylift-ray.service" in pool.user_data


def test_efs_mounted_at_same_path_everywhere(full_stack: Stack) -> None:
    efs_id = full_stack.outputs["efsId"]
    for pool in full_stack.pools.values():
        assert f"EFS_ID='{efs_id}'\n" in pool.user_data
        assert "MOUNT_PATH='/mnt/shared'\n" in pool.user_data


@pytest.mark.parametrize("stack_name", ["full", "example"])
def test_imdsv2_and_encrypted_root_everywhere(
    stack_name: str, full_stack: Stack, example_stack: Stack
) -> None:
    stack = full_stack if stack_name == "full" else example_stack
    lts = stack.of_type(LT)
    assert len(lts) == len(stack.pools)
    for lt in lts:
        meta = lt["inputs"]["metadataOptions"]
        assert meta["httpTokens"] == "required"
        assert meta["httpPutResponseHopLimit"] == 2
        mappings = lt["inputs"]["blockDeviceMappings"]
        assert mappings, lt["name"]
        for m in mappings:
            assert m["ebs"]["encrypted"] == "true"
            assert m["ebs"]["volumeSize"] >= 100
    assert not stack.of_type("aws:ec2/instance:Instance")  # every node comes from an LT


def _ingress(stack: Stack) -> list[dict[str, Any]]:
    rules = [r["inputs"] for r in stack.of_type(INGRESS)]
    assert not stack.of_type(SG_RULE)
    for sg in stack.of_type(SG):
        assert not sg["inputs"].get("ingress"), "inline ingress bypasses the rule checks"
    return rules


def test_no_ingress_from_anywhere(full_stack: Stack) -> None:
    rules = _ingress(full_stack)
    assert rules
    for rule in rules:
        assert "cidrIpv4" not in rule and "cidrIpv6" not in rule and "prefixListId" not in rule
        assert rule["referencedSecurityGroupId"]
        assert not rule["fromPort"] <= 22 <= rule["toPort"]  # SSH closed


def _cluster_sg_id(stack: Stack) -> str:
    (lt_sgs,) = {tuple(lt["inputs"]["vpcSecurityGroupIds"]) for lt in stack.of_type(LT)}
    (sg_id,) = lt_sgs
    return sg_id


def test_ray_ports_only_from_cluster_group(full_stack: Stack) -> None:
    cluster = _cluster_sg_id(full_stack)
    on_cluster = [r for r in _ingress(full_stack) if r["securityGroupId"] == cluster]
    for rule in on_cluster:
        assert rule["referencedSecurityGroupId"] == cluster
        assert rule["ipProtocol"] == "tcp"

    def reachable(port: int) -> bool:
        return any(r["fromPort"] <= port <= r["toPort"] for r in on_cluster)

    # Every port the real ray start lines bind must be open (from the group) ...
    port_flags = [
        "port",
        "dashboard-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
        "runtime-env-agent-port",
        "dashboard-agent-grpc-port",
        "dashboard-agent-listen-port",
        "metrics-export-port",
    ]
    bound: set[int] = set()
    for pool in full_stack.pools.values():
        flags = pool.ray_start
        bound |= {int(flags[f]) for f in port_flags if f in flags}
        low, high = int(flags["min-worker-port"]), int(flags["max-worker-port"])
        assert all(reachable(p) for p in (low, (low + high) // 2, high))
    assert {6379, 8265, 10001} <= bound
    assert all(reachable(p) for p in bound)
    # ... and nothing else is: total opened TCP span stays small and explicit.
    assert not reachable(22)
    assert not reachable(443)


def test_efs_and_endpoints_groups_accept_only_the_cluster(full_stack: Stack) -> None:
    cluster = _cluster_sg_id(full_stack)
    others = [r for r in _ingress(full_stack) if r["securityGroupId"] != cluster]
    assert sorted((r["fromPort"], r["toPort"]) for r in others) == [(443, 443), (2049, 2049)]
    assert all(r["referencedSecurityGroupId"] == cluster for r in others)
    (efs,) = [
        r["inputs"]["securityGroupId"]
        for r in full_stack.of_type(INGRESS)
        if r["inputs"]["fromPort"] == 2049
    ]
    for mt in full_stack.of_type("aws:efs/mountTarget:MountTarget"):
        assert mt["inputs"]["securityGroups"] == [efs]


def test_s3_private_encrypted_versioned_with_lifecycle(full_stack: Stack) -> None:
    bucket = full_stack.one(BUCKET)
    name = bucket["id"]
    assert full_stack.outputs["bucket"] == name
    pab = full_stack.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")["inputs"]
    assert pab["bucket"] == name
    for key in (
        "blockPublicAcls",
        "blockPublicPolicy",
        "ignorePublicAcls",
        "restrictPublicBuckets",
    ):
        assert pab[key] is True, key
    sse = full_stack.one(
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    )["inputs"]
    assert sse["bucket"] == name
    assert sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
    versioning = full_stack.one("aws:s3/bucketVersioning:BucketVersioning")["inputs"]
    assert versioning["bucket"] == name
    assert versioning["versioningConfiguration"]["status"] == "Enabled"
    lifecycle = full_stack.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    rules = {r["id"]: r for r in lifecycle["inputs"]["rules"]}
    assert rules["expire-old-checkpoints"]["filter"]["prefix"] == "checkpoints/"
    assert rules["expire-old-checkpoints"]["expiration"]["days"] == 30
    assert rules["abort-incomplete-multipart-uploads"]["abortIncompleteMultipartUpload"]
    policy = json.loads(full_stack.one("aws:s3/bucketPolicy:BucketPolicy")["inputs"]["policy"])
    (deny,) = policy["Statement"]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_efs_encrypted_with_mount_target_per_private_subnet(full_stack: Stack) -> None:
    fs = full_stack.one("aws:efs/fileSystem:FileSystem")
    assert fs["inputs"]["encrypted"] is True
    assert full_stack.outputs["efsId"] == fs["id"]
    private = {
        s["id"] for s in full_stack.of_type("aws:ec2/subnet:Subnet") if "-private-" in s["name"]
    }
    assert len(private) == 3
    targets = [m["inputs"] for m in full_stack.of_type("aws:efs/mountTarget:MountTarget")]
    assert sorted(t["subnetId"] for t in targets) == sorted(private)
    assert all(t["fileSystemId"] == fs["id"] for t in targets)
    # And the pools run in exactly those subnets, so every node has a local mount target.
    for pool in full_stack.pools.values():
        assert set(pool.asg["inputs"]["vpcZoneIdentifiers"]) == private


def test_subnets_span_azs_and_are_private(full_stack: Stack) -> None:
    subnets = [s["inputs"] for s in full_stack.of_type("aws:ec2/subnet:Subnet")]
    assert all(s["mapPublicIpOnLaunch"] is False for s in subnets)
    private_azs = {
        s["inputs"]["availabilityZone"]
        for s in full_stack.of_type("aws:ec2/subnet:Subnet")
        if "-private-" in s["name"]
    }
    assert private_azs == {"us-east-1a", "us-east-1b", "us-east-1c"}
    assert len(full_stack.of_type("aws:ec2/natGateway:NatGateway")) == 3  # natGateway: per-az
    s3_gateway = [
        e["inputs"]
        for e in full_stack.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
        if e["inputs"]["vpcEndpointType"] == "Gateway"
    ]
    assert [e["serviceName"] for e in s3_gateway] == ["com.amazonaws.us-east-1.s3"]
    interface = {
        e["inputs"]["serviceName"].rsplit(".", 2)[-2:][0]
        + "."
        + e["inputs"]["serviceName"].rsplit(".", 1)[-1]
        for e in full_stack.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
        if e["inputs"]["vpcEndpointType"] == "Interface"
    }
    assert {"ecr.api", "ecr.dkr"} <= interface


def _statements(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    return {
        p["name"]: json.loads(p["inputs"]["policy"])["Statement"]
        for p in stack.of_type(ROLE_POLICY)
    }


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def test_iam_scoped_to_this_bucket_and_these_repos(full_stack: Stack) -> None:
    bucket_arn = f"arn:aws:s3:::{full_stack.outputs['bucket']}"
    repo_arns = {
        r["inputs"]["name"]: f"arn:aws:ecr:us-east-1:123456789012:repository/{r['inputs']['name']}"
        for r in full_stack.of_type("aws:ecr/repository:Repository")
    }
    assert sorted(repo_arns) == ["raylift/base", "raylift/bnb", "raylift/ccl", "raylift/trainer"]
    seen_actions: set[str] = set()
    for name, statements in _statements(full_stack).items():
        for stmt in statements:
            actions = _as_list(stmt["Action"])
            resources = _as_list(stmt["Resource"])
            seen_actions |= set(actions)
            assert "*" not in actions and "*:*" not in actions, name
            if any(a.startswith("s3:") for a in actions):
                assert all(r == bucket_arn or r.startswith(f"{bucket_arn}/") for r in resources)
            if any(a.startswith("ecr:") for a in actions):
                if resources == ["*"]:
                    # AWS has no resource-level permission for the registry login, only this.
                    assert actions == ["ecr:GetAuthorizationToken"], (name, stmt)
                else:
                    assert set(resources) <= set(repo_arns.values()), (name, stmt)
            if any(a.startswith("secretsmanager:") for a in actions):
                assert resources == [full_stack.outputs["rayAuthTokenSecretArn"]]
            if any(a.startswith("route53:") for a in actions):
                assert name.endswith("-head-dns"), "only the head may move the head's name"
    assert {"s3:GetObject", "s3:PutObject", "ecr:BatchGetImage"} <= seen_actions


def test_head_and_workers_use_different_roles(full_stack: Stack) -> None:
    profiles = {
        name: pool.launch_template["inputs"]["iamInstanceProfile"]["arn"]
        for name, pool in full_stack.pools.items()
    }
    head = profiles.pop("head")
    assert head.endswith("-head")
    assert {p for p in profiles.values()} == {head.replace("-head", "-worker")}


def test_spot_pool_allocation(full_stack: Stack) -> None:
    spot = full_stack.pools["gpu-spot"].asg["inputs"]
    dist = spot["mixedInstancesPolicy"]["instancesDistribution"]
    assert dist["spotAllocationStrategy"] == "price-capacity-optimized"
    assert dist["onDemandBaseCapacity"] == 0
    assert dist["onDemandPercentageAboveBaseCapacity"] == 0
    for name, pool in full_stack.pools.items():
        if name != "gpu-spot":
            assert "mixedInstancesPolicy" not in pool.asg["inputs"], name


def test_token_auth_on_by_default(full_stack: Stack) -> None:
    password = full_stack.one("random:index/randomPassword:RandomPassword")["inputs"]
    assert password["length"] >= 32 and password["special"] is False
    version = full_stack.one("aws:secretsmanager/secretVersion:SecretVersion")["inputs"]
    token_value = version["secretString"]
    arn = full_stack.outputs["rayAuthTokenSecretArn"]
    assert arn.startswith("arn:aws:secretsmanager:")
    for name, pool in full_stack.pools.items():
        assert f"TOKEN_SECRET_ARN='{arn}'\n" in pool.user_data, name
        assert token_value not in pool.user_data, "the token itself must never be in user data"
        assert "TOKEN_AUTH=1\n" in pool.user_data
        assert "RAY_AUTH_MODE=token" in pool.user_data
        assert "RAY_AUTH_TOKEN_PATH=" in pool.user_data
    assert token_value not in json.dumps(full_stack.outputs)


def test_token_auth_can_be_turned_off(run_stack: StackRunner, full_stack: Stack) -> None:
    """Rendered both ways: the token settings differ exactly where token auth is decided."""
    stack = run_stack({**FULL_CONFIG, "raylift:ray": {"tokenAuth": False}})
    assert not stack.of_type("aws:secretsmanager/secret:Secret")
    assert stack.outputs["rayAuthTokenSecretArn"] is None
    assert not any("secretsmanager:" in json.dumps(s) for s in _statements(stack).values())
    arn = full_stack.outputs["rayAuthTokenSecretArn"]
    for name, pool in stack.pools.items():
        on, off = full_stack.pools[name].user_data, pool.user_data
        assert ("TOKEN_AUTH=1\n" in on, "TOKEN_AUTH=1\n" in off) == (True, False), name
        assert ("TOKEN_AUTH=0\n" in on, "TOKEN_AUTH=0\n" in off) == (False, True), name
        assert f"TOKEN_SECRET_ARN='{arn}'\n" in on and "TOKEN_SECRET_ARN=''\n" in off, name
        # Everything else about the node is the same: only the token lines differ.
        differing = {line.split("=", 1)[0] for line in set(on.splitlines()) ^ set(off.splitlines())}
        assert differing == {"TOKEN_AUTH", "TOKEN_SECRET_ARN"}, (name, differing)


def test_registry_scan_on_push_and_immutable(full_stack: Stack) -> None:
    repos = full_stack.of_type("aws:ecr/repository:Repository")
    assert len(repos) == 4
    for repo in repos:
        assert repo["inputs"]["imageScanningConfiguration"] == {"scanOnPush": True}
        assert repo["inputs"]["imageTagMutability"] == "IMMUTABLE"


def test_head_dns_is_private_and_published_by_head_only(full_stack: Stack) -> None:
    zone = full_stack.one("aws:route53/zone:Zone")["inputs"]
    assert zone["name"] == "full.raylift.internal"
    assert zone["vpcs"]  # a private hosted zone
    head = full_stack.pools["head"].user_data
    assert f"HOSTED_ZONE_ID='{full_stack.one('aws:route53/zone:Zone')['id']}'\n" in head
    worker = full_stack.pools["gpu-spot"].user_data
    assert "HOSTED_ZONE_ID=''\n" in worker


def test_outputs(full_stack: Stack) -> None:
    out = full_stack.outputs
    head_asg = full_stack.pools["head"].asg
    assert head_asg["inputs"]["namePrefix"] in out["jobsApiPortForward"]
    assert "AWS-StartPortForwardingSession" in out["jobsApiPortForward"]
    assert '"portNumber":["8265"]' in out["jobsApiPortForward"]
    assert out["jobsApiLocalAddress"] == "http://127.0.0.1:8265"
    assert set(out["repositories"]) == {"base", "bnb", "ccl", "trainer"}


def test_summary_prices_from_catalog(full_stack: Stack) -> None:
    summary = full_stack.outputs["summary"]
    expected_total = 0.0
    for name, pool in full_stack.pools.items():
        row = summary["pools"][name]
        spec = get_instance(pool.instance_types[0])
        price = spec.spot_usd_per_hour if pool.market == "spot" else spec.on_demand_usd_per_hour
        assert row["nodes"] == pool.size
        assert row["gpus"] == spec.gpu_count * pool.size
        assert row["usdPerHour"] == pytest.approx(price * pool.size, abs=0.001)
        expected_total += price * pool.size
    assert summary["totalUsdPerHour"] == pytest.approx(expected_total, abs=0.01)
    # 2×g5.12xlarge (4) + 5 spot (1) + g5.24xlarge (4) = 17 GPUs
    assert summary["totalGpus"] == 17


def test_existing_vpc(run_stack: StackRunner) -> None:
    subnets = ["subnet-aaa", "subnet-bbb"]
    stack = run_stack(
        {
            **FULL_CONFIG,
            "raylift:network": {"existingVpcId": "vpc-123", "existingPrivateSubnetIds": subnets},
        }
    )
    assert not stack.of_type("aws:ec2/vpc:Vpc")
    assert not stack.of_type("aws:ec2/subnet:Subnet")
    assert not stack.of_type("aws:ec2/natGateway:NatGateway")
    mts = stack.of_type("aws:efs/mountTarget:MountTarget")
    assert sorted(m["inputs"]["subnetId"] for m in mts) == subnets
    for pool in stack.pools.values():
        assert pool.asg["inputs"]["vpcZoneIdentifiers"] == subnets
    assert {sg["inputs"]["vpcId"] for sg in stack.of_type(SG)} == {"vpc-123"}


def test_bad_config_fails_with_the_key_name(run_stack: StackRunner) -> None:
    bad = {**FULL_CONFIG, "raylift:pools": {"gpuSpot": {"instanceTypes": ["g9.huge"], "size": 1}}}
    error = run_stack.failure(bad)
    assert "raylift:pools.gpuSpot.instanceTypes" in error
    assert "g9.huge" in error


def test_asg_and_lt_counts_match(full_stack: Stack) -> None:
    assert len(full_stack.of_type(ASG)) == len(full_stack.of_type(LT)) == 5


def test_root_volumes_sized_from_config(full_stack: Stack) -> None:
    sizes = {
        name: pool.launch_template["inputs"]["blockDeviceMappings"][0]["ebs"]["volumeSize"]
        for name, pool in full_stack.pools.items()
    }
    # Defaults from infra/settings.py: head 100 GiB, rank-0 node 500 GiB, other pools 200 GiB.
    assert sizes == {
        "head": 100,
        "gpu-ondemand": 200,
        "gpu-spot": 200,
        "large-cpu-mem": 500,
        "cpu": 200,
    }


def test_user_data_fits_the_ec2_limit(full_stack: Stack) -> None:
    # EC2 rejects user data over 16 KB (before base64) at launch time, not at `pulumi up`.
    for name, pool in full_stack.pools.items():
        assert len(pool.user_data.encode()) < 16 * 1024, name


def test_entrypoint_runs_like_the_pulumi_cli(run_stack: StackRunner, example_stack: Stack) -> None:
    """`pulumi up` runs infra/__main__.py from infra/ without the repo root on sys.path."""
    via_cli = run_stack.entrypoint(stack_file_config(INFRA / "Pulumi.example.yaml"))
    assert sorted((r["type"], r["name"]) for r in via_cli.resources) == sorted(
        (r["type"], r["name"]) for r in example_stack.resources
    )


def test_customer_managed_kms_key(run_stack: StackRunner) -> None:
    key = "arn:aws:kms:us-east-1:123456789012:key/0b1c2d3e-0000-1111-2222-333344445555"
    stack = run_stack({**FULL_CONFIG, "raylift:storage": {"kmsKeyArn": key}})
    sse = stack.one(
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    )["inputs"]["rules"][0]
    assert sse["applyServerSideEncryptionByDefault"] == {
        "sseAlgorithm": "aws:kms",
        "kmsMasterKeyId": key,
    }
    assert sse["bucketKeyEnabled"] is True
    assert stack.one("aws:efs/fileSystem:FileSystem")["inputs"]["kmsKeyId"] == key


PUSHED = "trainer-gpu-1.2.3-abcdef0"


def test_pools_wait_for_everything_a_node_needs_at_boot(full_stack: Stack) -> None:
    needed = {
        r["name"]
        for r in full_stack.resources
        if r["type"]
        in {
            "aws:efs/mountTarget:MountTarget",
            "aws:secretsmanager/secretVersion:SecretVersion",
            "aws:iam/rolePolicy:RolePolicy",
            "aws:iam/instanceProfile:InstanceProfile",
            "aws:ec2/natGateway:NatGateway",
            "aws:ec2/routeTableAssociation:RouteTableAssociation",
            "aws:route53/zone:Zone",
        }
        and "-public-" not in r["name"]
    }
    assert len(needed) >= 3 + 1 + 3 + 2 + 3 + 3 + 1
    for name, pool in full_stack.pools.items():
        missing = needed - set(pool.asg["dependsOn"])
        assert not missing, (name, sorted(missing))


def test_groups_never_end_healthy_training_nodes(full_stack: Stack) -> None:
    for name, pool in full_stack.pools.items():
        asg = pool.asg["inputs"]
        assert asg["suspendedProcesses"] == ["AZRebalance"], name
        assert asg["capacityRebalance"] is False, name
        # A node that gives up on its boot shuts down; that must end it, not stop it.
        lt = pool.launch_template["inputs"]
        assert lt["instanceInitiatedShutdownBehavior"] == "terminate", name


def test_workers_have_a_drain_hook_the_node_can_complete(full_stack: Stack) -> None:
    hooks = {
        h["inputs"]["autoscalingGroupName"]: h["inputs"]
        for h in full_stack.of_type("aws:autoscaling/lifecycleHook:LifecycleHook")
    }
    asg_names = {
        name: p.asg["inputs"]["namePrefix"] + "20251122" for name, p in full_stack.pools.items()
    }
    assert set(hooks) == {n for p, n in asg_names.items() if p != "head"}
    for hook in hooks.values():
        assert hook["lifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
        assert hook["name"] == "raylift-drain"
        assert hook["defaultResult"] == "CONTINUE"
        assert 120 <= hook["heartbeatTimeout"] <= 900
    for name, pool in full_stack.pools.items():
        expected = "raylift-drain" if name != "head" else ""
        assert f"LIFECYCLE_HOOK='{expected}'\n" in pool.user_data, name
    (stmt,) = [
        s
        for statements in _statements(full_stack).values()
        for s in statements
        if s["Sid"] == "OwnAutoScalingGroup"
    ][:1]
    assert set(stmt["Action"]) == {
        "autoscaling:SetInstanceHealth",
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:RecordLifecycleActionHeartbeat",
    }
    assert stmt["Resource"] == [
        "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:autoScalingGroupName/full-*"
    ]
    assert stmt["Condition"] == {
        "StringEquals": {"autoscaling:ResourceTag/raylift:cluster": "full"}
    }
    for asg in full_stack.of_type(ASG):
        tags = {t["key"]: t["value"] for t in asg["inputs"]["tags"]}
        assert tags["raylift:cluster"] == "full"


def test_unit_requires_the_efs_mount(full_stack: Stack) -> None:
    for name, pool in full_stack.pools.items():
        assert _systemd_unit(pool.user_data)["RequiresMountsFor"] == "/mnt/shared", name


def test_node_role_cannot_read_ssm_parameters_or_delete_everything(full_stack: Stack) -> None:
    assert not full_stack.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    bucket_arn = f"arn:aws:s3:::{full_stack.outputs['bucket']}"
    for name, statements in _statements(full_stack).items():
        actions = {a for s in statements for a in _as_list(s["Action"])}
        assert not any(a.startswith(("ssm:Get", "ssm:Describe", "ssm:List")) for a in actions)
        for stmt in statements:
            if "s3:DeleteObject" in _as_list(stmt["Action"]):
                assert _as_list(stmt["Action"]) == ["s3:DeleteObject"], name
                assert stmt["Resource"] == [
                    f"{bucket_arn}/checkpoints/*/step_*",
                    f"{bucket_arn}/checkpoints/*.raylift-write-probe-*",
                ]
    node = _statements(full_stack)["full-worker-node"]
    (session,) = [s for s in node if s["Sid"] == "SessionManager"]
    assert "ssm:UpdateInstanceInformation" in session["Action"]
    assert "ssmmessages:OpenDataChannel" in session["Action"]


def test_kms_key_is_usable_by_nodes(run_stack: StackRunner, full_stack: Stack) -> None:
    key = "arn:aws:kms:us-east-1:123456789012:key/0b1c2d3e-0000-1111-2222-333344445555"
    stack = run_stack({**FULL_CONFIG, "raylift:storage": {"kmsKeyArn": key}})
    for name, statements in _statements(stack).items():
        if not name.endswith("-node"):
            continue
        (kms,) = [s for s in statements if any(a.startswith("kms:") for a in s["Action"])]
        assert sorted(kms["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey"]
        assert kms["Resource"] == [key]
    # Without a customer key nothing about KMS is granted.
    assert "kms:" not in json.dumps(_statements(full_stack))


def test_root_volume_is_fast_gp3(full_stack: Stack) -> None:
    for name, pool in full_stack.pools.items():
        ebs = pool.launch_template["inputs"]["blockDeviceMappings"][0]["ebs"]
        assert ebs["volumeType"] == "gp3"
        assert ebs["throughput"] == 1000, name  # MB/s, not the 125 baseline
        assert ebs["iops"] >= 4000, name  # gp3 needs 4 IOPS per MB/s


def test_ami_is_resolved_once_and_recorded(full_stack: Stack) -> None:
    (lookup,) = [i for i in full_stack.invokes if i["token"] == "aws:ssm/getParameter:getParameter"]
    assert "deeplearning" in lookup["args"]["name"]
    (record,) = full_stack.of_type("aws:ssm/parameter:Parameter")
    assert record["ignoreChanges"] == ["value"]  # later `pulumi up`s never move it
    assert record["inputs"]["value"] == "ami-0123456789abcdef0"
    for name, pool in full_stack.pools.items():
        assert pool.launch_template["inputs"]["imageId"] == "ami-0123456789abcdef0", name
    assert full_stack.outputs["ami"] == "ami-0123456789abcdef0"


def test_image_tags_are_looked_up_in_ecr(full_stack: Stack) -> None:
    looked_up = sorted(
        (i["args"]["repositoryName"], i["args"]["imageTag"])
        for i in full_stack.invokes
        if i["token"] == "aws:ecr/getImage:getImage"
    )
    assert looked_up == [
        ("raylift/trainer", "trainer-cpu-1.2.3-abcdef0"),
        ("raylift/trainer", "trainer-gpu-1.2.3-abcdef0"),
    ]


@pytest.mark.parametrize("missing", [PUSHED, "trainer-cpu-1.2.3-abcdef0"])
def test_preview_fails_when_the_tag_is_not_in_ecr(run_stack: StackRunner, missing: str) -> None:
    error = run_stack.failure({**FULL_CONFIG, "harness:missingImageTags": [missing]})
    assert f"image raylift/trainer:{missing}" in error
    assert "is not in ECR" in error and "make push" in error


def test_tag_comes_from_the_file_make_push_writes(run_stack: StackRunner, tmp_path_factory) -> None:
    tag_file = tmp_path_factory.mktemp("tags") / "image-tag"
    tag_file.write_text("trainer-gpu-0.2.0-1234567\n")
    stack = run_stack({**FULL_CONFIG, "raylift:image": {"tagFile": str(tag_file)}})
    repo = stack.outputs["repositories"]["trainer"]
    assert stack.outputs["image"] == f"{repo}:trainer-gpu-0.2.0-1234567"
    assert f"IMAGE='{repo}:trainer-cpu-0.2.0-1234567'\n" in stack.pools["cpu"].user_data
    assert f"IMAGE='{repo}:trainer-gpu-0.2.0-1234567'\n" in stack.pools["gpu-spot"].user_data


def test_no_tag_yet_creates_everything_but_the_pools(
    run_stack: StackRunner, tmp_path_factory
) -> None:
    absent = tmp_path_factory.mktemp("none") / "image-tag"
    stack = run_stack({**FULL_CONFIG, "raylift:image": {"tagFile": str(absent)}})
    assert not stack.of_type(ASG) and not stack.of_type(LT)
    assert len(stack.of_type("aws:ecr/repository:Repository")) == 4
    assert any("no node pools" in w and "make image push" in w for w in stack.warnings)
    assert not [i for i in stack.invokes if i["token"] == "aws:ecr/getImage:getImage"]


def test_capacity_problems_are_not_silent(full_stack: Stack) -> None:
    topic = full_stack.one("aws:sns/topic:Topic")
    notes = full_stack.of_type("aws:autoscaling/notification:Notification")
    assert len(notes) == len(full_stack.pools)
    for note in notes:
        assert "autoscaling:EC2_INSTANCE_LAUNCH_ERROR" in note["inputs"]["notifications"]
        assert note["inputs"]["topicArn"] == full_stack.outputs["capacityAlertsTopic"]
    assert topic["name"].startswith("full")
    # The preview says which vCPU quotas the pools need, and warns where the account's is lower.
    needs = full_stack.outputs["summary"]["vcpuQuotasNeeded"]
    assert needs["L-3819A6DF"]["vcpus"] == 5 * 32  # spot: largest listed type, g5.8xlarge
    assert needs["L-DB2E81BA"]["vcpus"] == 2 * 48 + 96  # g5.12xlarge x2 + g5.24xlarge
    assert any("L-3819A6DF" in w and "160 vCPUs" in w for w in full_stack.warnings)


def test_cpu_pool_needs_a_derivable_or_named_cpu_tag(run_stack: StackRunner) -> None:
    error = run_stack.failure({**FULL_CONFIG, "raylift:image": {"tag": "hand-named-1"}})
    assert "raylift:image.cpuTag" in error
    stack = run_stack(
        {**FULL_CONFIG, "raylift:image": {"tag": "hand-named-1", "cpuTag": "hand-named-1-cpu"}}
    )
    repo = stack.outputs["repositories"]["trainer"]
    assert f"IMAGE='{repo}:hand-named-1-cpu'\n" in stack.pools["cpu"].user_data
