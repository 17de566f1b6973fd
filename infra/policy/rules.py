"""Raylift's security invariants as Pulumi policies (the pack itself is policy/__main__.py).

These run on every `pulumi preview/up --policy-pack infra/policy` and hold for ANY program in
the account, not just ours: they are the guard rails the ShadowRay attacks and the Ray cluster
launcher's SSH-open-to-the-world default taught us. Props are the engine's camelCase resource
inputs; during a preview some may be unknown (None), and a rule only judges what it can see.

Self-contained on purpose (no imports from infra/): the policy pack runs in its own process.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

OPEN_CIDRS = {"0.0.0.0/0", "::/0"}
SSH_PORT = 22
# The one action AWS only grants on "*" (it has no resource-level permissions).
STAR_RESOURCE_ALLOWED_ACTIONS = {"ecr:GetAuthorizationToken"}
STRICT_SERVICES = ("s3:", "ecr:")

Props = Mapping[str, Any]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _covers(from_port: Any, to_port: Any, port: int, protocol: Any) -> bool:
    if str(protocol) in {"-1", "all"}:
        return True
    if from_port is None or to_port is None:
        return False
    return int(from_port) <= port <= int(to_port)


# --- security groups --------------------------------------------------------------------------


def _ingress_entries(resource_type: str, props: Props) -> Iterable[dict[str, Any]]:
    """Normalise the three ways to express ingress into dicts with cidrs/sgs/ports."""
    if resource_type == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
        yield {
            "cidrs": [c for c in (props.get("cidrIpv4"), props.get("cidrIpv6")) if c],
            "prefix_lists": _as_list(props.get("prefixListId")),
            "sgs": _as_list(props.get("referencedSecurityGroupId")),
            "from": props.get("fromPort"),
            "to": props.get("toPort"),
            "protocol": props.get("ipProtocol"),
        }
    elif resource_type == "aws:ec2/securityGroupRule:SecurityGroupRule":
        if props.get("type") == "ingress":
            yield {
                "cidrs": _as_list(props.get("cidrBlocks")) + _as_list(props.get("ipv6CidrBlocks")),
                "prefix_lists": _as_list(props.get("prefixListIds")),
                "sgs": _as_list(props.get("sourceSecurityGroupId"))
                + (["self"] if props.get("self") else []),
                "from": props.get("fromPort"),
                "to": props.get("toPort"),
                "protocol": props.get("protocol"),
            }
    elif resource_type == "aws:ec2/securityGroup:SecurityGroup":
        for rule in _as_list(props.get("ingress")):
            yield {
                "cidrs": _as_list(rule.get("cidrBlocks")) + _as_list(rule.get("ipv6CidrBlocks")),
                "prefix_lists": _as_list(rule.get("prefixListIds")),
                "sgs": _as_list(rule.get("securityGroups"))
                + (["self"] if rule.get("self") else []),
                "from": rule.get("fromPort"),
                "to": rule.get("toPort"),
                "protocol": rule.get("protocol"),
            }


def no_public_ingress(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Nothing is reachable from the internet: no ingress from 0.0.0.0/0 or ::/0, any port."""
    for entry in _ingress_entries(args.resource_type, args.props):
        open_cidrs = OPEN_CIDRS.intersection(entry["cidrs"])
        if open_cidrs:
            report_violation(
                f"ingress from {sorted(open_cidrs)} on ports {entry['from']}-{entry['to']}; "
                "reach the cluster through SSM Session Manager port forwarding instead",
                None,
            )


def ingress_from_security_groups_only(
    args: ResourceValidationArgs, report_violation: ReportViolation
) -> None:
    """Every ingress names a security group as its source (no CIDRs), and SSH stays closed."""
    for entry in _ingress_entries(args.resource_type, args.props):
        if entry["cidrs"] or entry["prefix_lists"]:
            report_violation(
                f"ingress on ports {entry['from']}-{entry['to']} from CIDR/prefix list "
                f"{entry['cidrs'] + entry['prefix_lists']}; use a security-group source",
                None,
            )
        elif not entry["sgs"]:
            report_violation("ingress rule without a source security group", None)
        if _covers(entry["from"], entry["to"], SSH_PORT, entry["protocol"]):
            report_violation("ingress covers SSH (22); use SSM Session Manager", None)


# --- EC2 launch templates / instances ----------------------------------------------------------


def imdsv2_required(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """IMDSv2 only, and a hop limit of at most 2 (enough for one container, no further)."""
    if args.resource_type not in {
        "aws:ec2/launchTemplate:LaunchTemplate",
        "aws:ec2/instance:Instance",
    }:
        return
    meta = args.props.get("metadataOptions") or {}
    if meta.get("httpTokens") != "required":
        report_violation("metadataOptions.httpTokens must be 'required' (IMDSv2)", None)
    hops = meta.get("httpPutResponseHopLimit")
    if hops is not None and int(hops) > 2:
        report_violation(f"metadataOptions.httpPutResponseHopLimit is {hops}; use 2", None)


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def encrypted_volumes(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Every EBS volume a launch template or instance defines is encrypted."""
    if args.resource_type == "aws:ec2/launchTemplate:LaunchTemplate":
        for mapping in _as_list(args.props.get("blockDeviceMappings")):
            ebs = mapping.get("ebs")
            if ebs is not None and not _truthy(ebs.get("encrypted")):
                report_violation(f"volume {mapping.get('deviceName')} is not encrypted", None)
    elif args.resource_type == "aws:ec2/instance:Instance":
        root = args.props.get("rootBlockDevice") or {}
        if not _truthy(root.get("encrypted")):
            report_violation("root volume is not encrypted", None)


# --- storage ------------------------------------------------------------------------------------

_PAB_FIELDS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")


def s3_public_access_blocked(
    args: ResourceValidationArgs, report_violation: ReportViolation
) -> None:
    """A bucket's public access block sets all four switches; buckets carry no public ACL."""
    if args.resource_type == "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock":
        off = [f for f in _PAB_FIELDS if args.props.get(f) is not True]
        if off:
            report_violation(f"public access block leaves {off} off", None)
    elif args.resource_type in {"aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2"}:
        acl = args.props.get("acl")
        if acl and acl != "private":
            report_violation(f"bucket ACL {acl!r}; buckets stay private", None)


def s3_encrypted(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Server-side encryption rules name a real algorithm (SSE-S3 or SSE-KMS)."""
    if args.resource_type not in {
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
        "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
    }:
        return
    rules = _as_list(args.props.get("rules"))
    if not rules:
        report_violation("encryption configuration has no rules", None)
    for rule in rules:
        default = rule.get("applyServerSideEncryptionByDefault") or {}
        if default.get("sseAlgorithm") not in {"AES256", "aws:kms", "aws:kms:dsse"}:
            report_violation(f"unsupported SSE algorithm {default.get('sseAlgorithm')!r}", None)


def _bucket_keys(props: Props) -> set[str]:
    return {v for v in (props.get("bucket"), props.get("id")) if isinstance(v, str)}


def s3_buckets_guarded(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """Every bucket in the stack has a full public access block and an encryption config."""
    by_type: dict[str, list] = {}
    for res in args.resources:
        by_type.setdefault(res.resource_type, []).append(res)
    guarded_pab = {
        key
        for res in by_type.get("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", [])
        if all(res.props.get(f) is True for f in _PAB_FIELDS)
        for key in _bucket_keys(res.props)
    }
    sse_type = (
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    )
    encrypted = {key for res in by_type.get(sse_type, []) for key in _bucket_keys(res.props)}
    for res in by_type.get("aws:s3/bucket:Bucket", []):
        keys = _bucket_keys(res.props)
        if not keys:
            continue  # name unknown during preview
        if not keys & guarded_pab:
            report_violation(f"bucket {res.name} has no full public access block", res.urn)
        if not keys & encrypted:
            report_violation(f"bucket {res.name} has no server-side encryption config", res.urn)


def efs_encrypted(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """EFS holds checkpoints and data: encrypted at rest, always."""
    if (
        args.resource_type == "aws:efs/fileSystem:FileSystem"
        and args.props.get("encrypted") is not True
    ):
        report_violation("EFS file system must set encrypted: true", None)


def ecr_scan_on_push(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Images are scanned for known CVEs when pushed, before any node pulls them."""
    if args.resource_type != "aws:ecr/repository:Repository":
        return
    scanning = args.props.get("imageScanningConfiguration") or {}
    if scanning.get("scanOnPush") is not True:
        report_violation("ECR repository must enable imageScanningConfiguration.scanOnPush", None)


# --- IAM ----------------------------------------------------------------------------------------

IAM_POLICY_TYPES = {
    "aws:iam/rolePolicy:RolePolicy": "policy",
    "aws:iam/policy:Policy": "policy",
    "aws:iam/userPolicy:UserPolicy": "policy",
    "aws:iam/groupPolicy:GroupPolicy": "policy",
    "aws:iam/role:Role": "assumeRolePolicy",
}


def iam_problems(document: Any) -> list[str]:
    """Why an IAM policy document is too broad (empty list = fine). Pure, for reuse in tests."""
    if isinstance(document, str):
        document = json.loads(document)
    problems = []
    for stmt in _as_list(document.get("Statement")):
        if stmt.get("Effect") != "Allow":
            continue
        if "NotAction" in stmt or "NotResource" in stmt:
            problems.append(f"statement {stmt.get('Sid', '?')} allows via NotAction/NotResource")
        actions = [str(a) for a in _as_list(stmt.get("Action"))]
        resources = [str(r) for r in _as_list(stmt.get("Resource"))]
        if any(a in {"*", "*:*"} for a in actions):
            problems.append(f"statement {stmt.get('Sid', '?')} allows every action")
        strict = [a for a in actions if a.lower().startswith(STRICT_SERVICES)]
        if "*" in resources and strict:
            excess = sorted(set(strict) - STAR_RESOURCE_ALLOWED_ACTIONS)
            if excess:
                problems.append(
                    f"statement {stmt.get('Sid', '?')} grants {excess} on every resource"
                )
        if any(a.lower() in {"s3:*", "ecr:*"} for a in actions):
            problems.append(f"statement {stmt.get('Sid', '?')} grants a whole service")
    return problems


def iam_least_privilege(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """No `*:*`, no whole-service grants, and no s3/ecr action on `*` except ECR login."""
    prop = IAM_POLICY_TYPES.get(args.resource_type)
    if prop is None:
        return
    document = args.props.get(prop)
    if not document:
        return  # unknown during preview
    try:
        problems = iam_problems(document)
    except (ValueError, AttributeError):
        report_violation(f"{prop} is not a JSON policy document", None)
        return
    for problem in problems:
        report_violation(problem, None)


# (name, description, validate): the single list both the pack and the tests read.
RESOURCE_RULES: list[tuple[str, str, Callable[[ResourceValidationArgs, ReportViolation], None]]] = [
    ("no-public-ingress", "No ingress from 0.0.0.0/0 or ::/0.", no_public_ingress),
    (
        "ingress-from-security-groups-only",
        "Ingress sources are security groups; SSH is closed.",
        ingress_from_security_groups_only,
    ),
    ("imdsv2-required", "Launch templates require IMDSv2.", imdsv2_required),
    ("encrypted-volumes", "EBS volumes are encrypted.", encrypted_volumes),
    ("s3-public-access-blocked", "S3 public access is blocked.", s3_public_access_blocked),
    ("s3-encrypted", "S3 buckets use server-side encryption.", s3_encrypted),
    ("efs-encrypted", "EFS file systems are encrypted.", efs_encrypted),
    ("ecr-scan-on-push", "ECR repositories scan on push.", ecr_scan_on_push),
    ("iam-least-privilege", "No *:* and no s3/ecr on *.", iam_least_privilege),
]

RESOURCE_POLICIES: list[ResourceValidationPolicy] = [
    ResourceValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
    )
    for name, description, validate in RESOURCE_RULES
]

STACK_POLICIES: list[StackValidationPolicy] = [
    StackValidationPolicy(
        name="s3-buckets-guarded",
        description="Every bucket has a full public access block and an encryption config.",
        validate=s3_buckets_guarded,
        enforcement_level=EnforcementLevel.MANDATORY,
    )
]
