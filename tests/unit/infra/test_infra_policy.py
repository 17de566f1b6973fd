"""The policy pack's rules, called directly on passing and failing resource props.

No policy-pack server is started: PolicyPack() would serve gRPC, so the rules live in
infra/policy/rules.py and are exercised here as plain functions. The last tests feed every
resource the real program creates through every rule: the program must pass its own pack.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from infra_stack import Stack
from pulumi_policy import ResourceValidationArgs

from infra.policy import rules


def violations(rule: str, resource_type: str, props: dict[str, Any]) -> list[str]:
    validate = {name: fn for name, _, fn in rules.RESOURCE_RULES}[rule]
    found: list[str] = []
    args = ResourceValidationArgs(
        resource_type=resource_type,
        props=props,
        urn=f"urn:pulumi:test::raylift::{resource_type}::x",
        name="x",
        opts=None,  # type: ignore[arg-type]
        provider=None,
    )
    validate(args, lambda message, urn=None: found.append(message))
    return found


INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SG = "aws:ec2/securityGroup:SecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
LT = "aws:ec2/launchTemplate:LaunchTemplate"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"

GOOD_INGRESS = {
    "securityGroupId": "sg-1",
    "referencedSecurityGroupId": "sg-1",
    "ipProtocol": "tcp",
    "fromPort": 6379,
    "toPort": 6379,
}


def test_no_public_ingress() -> None:
    assert violations("no-public-ingress", INGRESS, GOOD_INGRESS) == []
    open_rule = {**GOOD_INGRESS, "cidrIpv4": "0.0.0.0/0"}
    del open_rule["referencedSecurityGroupId"]
    assert violations("no-public-ingress", INGRESS, open_rule)
    assert violations(
        "no-public-ingress", INGRESS, {**open_rule, "cidrIpv4": None, "cidrIpv6": "::/0"}
    )
    inline = {
        "ingress": [
            {"protocol": "tcp", "fromPort": 8265, "toPort": 8265, "cidrBlocks": ["0.0.0.0/0"]}
        ]
    }
    assert violations("no-public-ingress", SG, inline)
    legacy = {
        "type": "ingress",
        "protocol": "tcp",
        "fromPort": 22,
        "toPort": 22,
        "cidrBlocks": ["0.0.0.0/0"],
    }
    assert violations("no-public-ingress", SG_RULE, legacy)
    # egress to anywhere is fine (nodes pull images)
    assert violations("no-public-ingress", SG_RULE, {**legacy, "type": "egress"}) == []


def test_ingress_from_security_groups_only() -> None:
    rule = "ingress-from-security-groups-only"
    assert violations(rule, INGRESS, GOOD_INGRESS) == []
    vpc_cidr = {**GOOD_INGRESS, "cidrIpv4": "10.0.0.0/8"}
    del vpc_cidr["referencedSecurityGroupId"]
    assert violations(rule, INGRESS, vpc_cidr)
    ssh = {**GOOD_INGRESS, "fromPort": 22, "toPort": 22}
    assert any("SSH" in v for v in violations(rule, INGRESS, ssh))
    all_traffic = {**GOOD_INGRESS, "ipProtocol": "-1", "fromPort": None, "toPort": None}
    assert any("SSH" in v for v in violations(rule, INGRESS, all_traffic))
    no_source = {k: v for k, v in GOOD_INGRESS.items() if k != "referencedSecurityGroupId"}
    assert violations(rule, INGRESS, no_source)


GOOD_LT = {
    "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 2},
    "blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"encrypted": "true"}}],
}


def test_imdsv2_required() -> None:
    assert violations("imdsv2-required", LT, GOOD_LT) == []
    assert violations(
        "imdsv2-required", LT, {**GOOD_LT, "metadataOptions": {"httpTokens": "optional"}}
    )
    assert violations("imdsv2-required", LT, {**GOOD_LT, "metadataOptions": None})
    deep = {"httpTokens": "required", "httpPutResponseHopLimit": 5}
    assert violations("imdsv2-required", LT, {**GOOD_LT, "metadataOptions": deep})
    assert violations("imdsv2-required", "aws:ec2/instance:Instance", {})
    assert violations("imdsv2-required", SG, {}) == []  # other types are not judged


def test_encrypted_volumes() -> None:
    assert violations("encrypted-volumes", LT, GOOD_LT) == []
    plain = {"blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"encrypted": "false"}}]}
    assert violations("encrypted-volumes", LT, plain)
    unset = {"blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"volumeSize": 100}}]}
    assert violations("encrypted-volumes", LT, unset)


PAB = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
SSE = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
FULL_PAB = {
    "bucket": "b",
    "blockPublicAcls": True,
    "blockPublicPolicy": True,
    "ignorePublicAcls": True,
    "restrictPublicBuckets": True,
}


def test_s3_public_access_blocked() -> None:
    assert violations("s3-public-access-blocked", PAB, FULL_PAB) == []
    assert violations("s3-public-access-blocked", PAB, {**FULL_PAB, "restrictPublicBuckets": False})
    assert violations("s3-public-access-blocked", "aws:s3/bucket:Bucket", {"acl": "public-read"})
    assert violations("s3-public-access-blocked", "aws:s3/bucket:Bucket", {"bucket": "b"}) == []


def test_s3_encrypted() -> None:
    good = {
        "bucket": "b",
        "rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}],
    }
    assert violations("s3-encrypted", SSE, good) == []
    assert violations("s3-encrypted", SSE, {"bucket": "b", "rules": []})
    bad = {
        "bucket": "b",
        "rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "none"}}],
    }
    assert violations("s3-encrypted", SSE, bad)


def _stack_violations(resources: list[SimpleNamespace]) -> list[str]:
    found: list[str] = []
    rules.s3_buckets_guarded(
        SimpleNamespace(resources=resources), lambda message, urn=None: found.append(message)
    )
    return found


def test_every_bucket_needs_a_block_and_encryption() -> None:
    def res(typ: str, props: dict) -> SimpleNamespace:
        return SimpleNamespace(resource_type=typ, props=props, name=typ.split(":")[-1], urn="u")

    bucket = res("aws:s3/bucket:Bucket", {"bucket": "b", "id": "b"})
    pab = res(PAB, FULL_PAB)
    sse = res(SSE, {"bucket": "b", "rules": [{}]})
    assert _stack_violations([bucket, pab, sse]) == []
    assert len(_stack_violations([bucket, sse])) == 1
    assert len(_stack_violations([bucket, pab])) == 1
    weak = res(PAB, {**FULL_PAB, "blockPublicPolicy": False})
    assert len(_stack_violations([bucket, weak, sse])) == 1
    other = res(PAB, {**FULL_PAB, "bucket": "someone-else"})
    assert len(_stack_violations([bucket, other, sse])) == 1


def test_efs_encrypted() -> None:
    fs = "aws:efs/fileSystem:FileSystem"
    assert violations("efs-encrypted", fs, {"encrypted": True}) == []
    assert violations("efs-encrypted", fs, {"encrypted": False})
    assert violations("efs-encrypted", fs, {})


def test_ecr_scan_on_push() -> None:
    repo = "aws:ecr/repository:Repository"
    assert (
        violations("ecr-scan-on-push", repo, {"imageScanningConfiguration": {"scanOnPush": True}})
        == []
    )
    assert violations("ecr-scan-on-push", repo, {})


def _doc(*statements: dict) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


@pytest.mark.parametrize(
    ("statement", "ok"),
    [
        ({"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}, True),
        ({"Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"}, True),
        ({"Effect": "Allow", "Action": "*", "Resource": "*"}, False),
        ({"Effect": "Allow", "Action": "*:*", "Resource": "arn:aws:s3:::b"}, False),
        ({"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}, False),
        (
            {
                "Effect": "Allow",
                "Action": ["ecr:GetAuthorizationToken", "ecr:BatchGetImage"],
                "Resource": "*",
            },
            False,
        ),
        ({"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::b"}, False),
        ({"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"}, False),
        ({"Effect": "Deny", "Action": "*", "Resource": "*"}, True),
    ],
)
def test_iam_least_privilege(statement: dict, ok: bool) -> None:
    found = violations("iam-least-privilege", ROLE_POLICY, {"policy": _doc(statement)})
    assert (found == []) is ok, found


def test_iam_unparseable_policy_is_a_violation() -> None:
    assert violations("iam-least-privilege", ROLE_POLICY, {"policy": "not json"})


def test_pack_lists_every_rule() -> None:
    names = [p.name for p in rules.RESOURCE_POLICIES] + [p.name for p in rules.STACK_POLICIES]
    assert len(names) == len(set(names)) == 10


@pytest.mark.parametrize("stack_name", ["full", "example"])
def test_program_passes_its_own_policy_pack(
    stack_name: str, full_stack: Stack, example_stack: Stack
) -> None:
    stack = full_stack if stack_name == "full" else example_stack
    judged = 0
    for resource in stack.resources:
        for rule, _, _ in rules.RESOURCE_RULES:
            found = violations(rule, resource["type"], resource["inputs"])
            assert found == [], (rule, resource["name"], found)
        judged += 1
    assert judged > 50
    resources = [
        SimpleNamespace(
            resource_type=r["type"],
            props={**r["inputs"], "id": r["id"]},
            name=r["name"],
            urn=r["name"],
        )
        for r in stack.resources
    ]
    assert _stack_violations(resources) == []
