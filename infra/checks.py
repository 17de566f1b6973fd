"""Preview-time checks against the account: things a stack file cannot know but AWS can.

Both run during `pulumi preview` (they are invokes, not resources), so a cluster that could not
work is refused, or at least explained, before any node is paid for.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.settings import StackSettings
from infra.summary import vcpu_needs


def check_image_in_ecr(repository: str, tag: str, source: str) -> None:
    """Fail the preview, in one line, when the tag was never pushed: otherwise every GPU node
    would boot, retry a pull of an image that does not exist, and be replaced, forever."""
    try:
        aws.ecr.get_image(repository_name=repository, image_tag=tag)
    except Exception as exc:  # the provider's error type is not part of its API
        reason = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else repr(exc)
        raise pulumi.RunError(
            f"image {repository}:{tag} (from {source}) is not in ECR: push it first "
            f"(`make push` writes the tag it pushed to build/image-tag) [{reason}]"
        ) from None


def report_quotas(settings: StackSettings) -> None:
    """Say at preview which vCPU quotas the pools need, and warn where the account's is lower."""
    for code, need in vcpu_needs(settings).items():
        try:
            quota = aws.servicequotas.get_service_quota(quota_code=code, service_code="ec2").value
        except Exception:  # no servicequotas permission: still say what is needed
            quota = None
        line = (
            f"pools {', '.join(need['pools'])} need {need['vcpus']} vCPUs of "
            f"'{need['quota']}' ({code}); this account's quota: "
            f"{'unknown' if quota is None else int(quota)}"
        )
        if quota is not None and quota < need["vcpus"]:
            pulumi.log.warn(
                f"{line}. The group will not get capacity until the quota is raised: "
                f"aws service-quotas request-service-quota-increase --service-code ec2 "
                f"--quota-code {code} --desired-value {need['vcpus']}"
            )
        else:
            pulumi.log.info(line)
