"""Run infra/program.py under pulumi mocks in THIS process and print what it created, as JSON.

The tests start this in a subprocess per stack config: Pulumi keeps its runtime state (root
stack, config, settings, event loop) in module globals and context variables, so a fresh
process per program is the only reset that cannot leak into other tests. No CLI, no cloud,
no provider plugin: every resource registration is answered by `Recorder.new_resource`.

Usage: python harness.py CONFIG.json [--entrypoint]
  CONFIG.json   a flat {"ns:key": value} map, like a stack file's `config:`
  --entrypoint  run infra/__main__.py the way the Pulumi CLI does (cwd infra/, infra/ first on
                sys.path, repository root NOT on it) instead of calling program.main()
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = "--entrypoint" in sys.argv
if not ENTRYPOINT:
    sys.path.insert(0, str(ROOT))

import pulumi  # noqa: E402
from pulumi.runtime.mocks import MockMonitor  # noqa: E402

ACCOUNT = "123456789012"
REGION = "us-east-1"
AZS = ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"]


# Tests that need an image to be missing from ECR name its tags under this config key; it is
# taken out of the config before the program sees it.
MISSING_IMAGES_KEY = "harness:missingImageTags"
AMI = "ami-0123456789abcdef0"


class Recorder(pulumi.runtime.Mocks):
    """Records every resource's real inputs and answers with plausible computed outputs."""

    def __init__(self, missing_tags: list[str] | None = None) -> None:
        self.resources: list[dict[str, Any]] = []
        self.invokes: list[dict[str, Any]] = []
        self.options: dict[tuple[str, str], dict[str, list[str]]] = {}
        self.missing_tags = set(missing_tags or [])

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
        inputs = dict(args.inputs)
        state = dict(inputs)
        rid = f"{args.name}-id"
        typ = args.typ
        if typ == "aws:s3/bucket:Bucket":
            bucket = inputs.get("bucket") or f"{args.name}-0a1b2c3"
            rid = bucket
            state.update(bucket=bucket, arn=f"arn:aws:s3:::{bucket}")
        elif typ == "aws:ecr/repository:Repository":
            repo = inputs["name"]
            state.update(
                arn=f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/{repo}",
                repositoryUrl=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{repo}",
            )
        elif typ == "aws:secretsmanager/secret:Secret":
            state["arn"] = f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:{args.name}-AbCdEf"
        elif typ == "random:index/randomPassword:RandomPassword":
            state["result"] = "t" * int(inputs.get("length", 16))
        elif typ == "aws:route53/zone:Zone":
            rid = "Z0123456789ABCDEFGHIJ"
            state.update(zoneId=rid, arn=f"arn:aws:route53:::hostedzone/{rid}")
        elif typ == "aws:efs/fileSystem:FileSystem":
            rid = "fs-0123456789abcdef0"
        elif typ == "aws:ec2/launchTemplate:LaunchTemplate":
            rid = f"lt-{abs(hash(args.name)) % 10**12:012d}"
            state["latestVersion"] = 1
        elif typ == "aws:autoscaling/group:Group":
            state["name"] = f"{inputs.get('namePrefix', args.name)}20251122"
        elif typ == "aws:iam/instanceProfile:InstanceProfile":
            state["arn"] = f"arn:aws:iam::{ACCOUNT}:instance-profile/{args.name}"
        elif typ.startswith("aws:"):
            state.setdefault("arn", f"arn:aws:mock:{REGION}:{ACCOUNT}:{args.name}")
        options = self.options.get((typ, args.name), {})
        self.resources.append(
            {"type": typ, "name": args.name, "id": rid, "inputs": inputs, **options}
        )
        return rid, state

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict | tuple[dict, list]:
        self.invokes.append({"token": args.token, "args": _plain(dict(args.args))})
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return {"names": AZS, "zoneIds": [f"use1-az{i}" for i in range(len(AZS))], "id": REGION}
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/t", "userId": "t"}
        if args.token == "aws:ssm/getParameter:getParameter":
            return {"name": args.args["name"], "value": AMI, "type": "String", "id": "p"}
        if args.token == "aws:servicequotas/getServiceQuota:getServiceQuota":
            # A young account: 64 vCPUs of everything.
            return {"quotaCode": args.args["quotaCode"], "value": 64.0, "id": "q"}
        if args.token == "aws:ecr/getImage:getImage":
            tag = args.args.get("imageTag")
            if tag in self.missing_tags:
                # How the engine reports the provider's answer for a tag never pushed: a failed
                # invoke, which the SDK raises at the call site.
                return {}, [
                    (
                        "imageTag",
                        f"ImageNotFoundException: The image with imageId {{imageTag:'{tag}'}} "
                        "does not exist within the repository",
                    )
                ]
            return {
                "imageDigest": "sha256:" + "ab" * 32,
                "imageTags": [tag],
                "repositoryName": args.args["repositoryName"],
                "id": "img",
            }
        raise NotImplementedError(f"unmocked invoke {args.token}")


class RecordingMonitor(MockMonitor):
    """The mock monitor, plus what `new_resource` cannot see: each resource's dependencies
    (explicit depends_on and input dependencies, as resource names) and ignoreChanges."""

    def __init__(self, mocks: Recorder) -> None:
        super().__init__(mocks)
        self.recorder = mocks

    def RegisterResource(self, request: Any) -> Any:
        self.recorder.options[(request.type, request.name)] = {
            "dependsOn": sorted({urn.rsplit("::", 1)[-1] for urn in request.dependencies}),
            "ignoreChanges": list(request.ignoreChanges),
        }
        return super().RegisterResource(request)


class WarningLog(logging.Handler):
    """Collects what the program logs through pulumi.log (warnings reach the user at preview)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _plain(value: Any) -> Any:
    """JSON-friendly copy of mock inputs (secrets unwrapped; the tests are the only reader)."""
    if isinstance(value, dict):
        if value.get("4dabf18193072939515e22adb298388d") == "1b47061264138c4ac30d75fd1eb44270":
            return _plain(value.get("value"))
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def run(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    recorder = Recorder(config.pop(MISSING_IMAGES_KEY, None))
    logger = logging.getLogger("raylift-harness")
    logger.propagate = False
    warnings = WarningLog()
    logger.addHandler(warnings)
    pulumi.runtime.set_mocks(
        recorder,
        project="raylift",
        stack="test",
        preview=False,
        logger=logger,
        monitor=RecordingMonitor(recorder),
    )
    pulumi.runtime.set_all_config(
        {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    )
    captured: dict[str, Any] = {}

    if ENTRYPOINT:
        import os
        import runpy

        os.chdir(ROOT / "infra")
        sys.path.insert(0, str(ROOT / "infra"))

        @pulumi.runtime.test
        def program() -> None:
            runpy.run_path(str(ROOT / "infra" / "__main__.py"), run_name="__main__")

    else:
        from infra.program import main

        @pulumi.runtime.test
        def program() -> pulumi.Output:
            return pulumi.Output.from_input(main()).apply(captured.update)

    program()
    return {
        "resources": _plain(recorder.resources),
        "outputs": _plain(captured),
        "invokes": recorder.invokes,
        "warnings": warnings.messages,
    }


if __name__ == "__main__":
    cfg = json.loads(Path(sys.argv[1]).read_text())
    json.dump(run(cfg), sys.stdout, default=str)
