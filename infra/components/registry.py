"""ECR repositories for the image graph (base → bnb → trainer, base → ccl → trainer).

Scan on push catches known CVEs before a cluster pulls an image; immutable tags (default) make
a tag mean one image forever, so every node of a cluster runs the same bits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.settings import RegistrySettings

# Untagged layers pile up with every rebuild; they are unreachable by tag and only cost money.
_EXPIRE_UNTAGGED = json.dumps(
    {
        "rules": [
            {
                "rulePriority": 1,
                "description": "expire untagged images after 14 days",
                "selection": {
                    "tagStatus": "untagged",
                    "countType": "sinceImagePushed",
                    "countUnit": "days",
                    "countNumber": 14,
                },
                "action": {"type": "expire"},
            }
        ]
    }
)


@dataclass(frozen=True)
class RegistryArgs:
    settings: RegistrySettings
    tags: dict[str, str] = field(default_factory=dict)


class Registry(pulumi.ComponentResource):
    """One ECR repository per image, named `<prefix>/<image>`."""

    repository_urls: dict[str, pulumi.Output[str]]
    repository_arns: dict[str, pulumi.Output[str]]

    def __init__(
        self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        s = args.settings
        self.repository_urls = {}
        self.repository_arns = {}
        for image in s.repositories:
            repo = aws.ecr.Repository(
                f"{name}-{image}",
                name=f"{s.prefix}/{image}",
                image_tag_mutability="IMMUTABLE" if s.immutable_tags else "MUTABLE",
                image_scanning_configuration={"scan_on_push": True},
                encryption_configurations=[{"encryption_type": "AES256"}],
                force_delete=s.force_delete,
                tags=args.tags,
                opts=child,
            )
            aws.ecr.LifecyclePolicy(
                f"{name}-{image}", repository=repo.name, policy=_EXPIRE_UNTAGGED, opts=child
            )
            self.repository_urls[image] = repo.repository_url
            self.repository_arns[image] = repo.arn
        self.register_outputs({"repositoryUrls": self.repository_urls})
