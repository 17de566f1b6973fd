"""Helpers for the infra tests: run the real Pulumi program under mocks and index what it made.

Each distinct stack config runs once per session in its own subprocess (see harness.py), so
Pulumi's global runtime state never leaks into other tests. Assertions look at the resource
inputs the mocks received, i.e. what `pulumi up` would send to AWS, not at program constants.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HARNESS = Path(__file__).with_name("harness.py")
INFRA = ROOT / "infra"

LT = "aws:ec2/launchTemplate:LaunchTemplate"
ASG = "aws:autoscaling/group:Group"


# The tag `make push` would have written; tests never read the checkout's build/image-tag.
PUSHED_TAG = "trainer-gpu-0.1.0-abcdef0"


def stack_file_config(path: Path, tag: str | None = PUSHED_TAG) -> dict[str, Any]:
    """The flat `config:` map of a Pulumi stack file, as the CLI would hand it to the program,
    with the image tag a `make push` would have produced (None: leave the file's own)."""
    config = dict(yaml.safe_load(path.read_text())["config"])
    if tag is not None:
        config["raylift:image"] = {**config.get("raylift:image", {}), "tag": tag}
    return config


def parse_ray_start(user_data: str) -> dict[str, Any]:
    """The `ray start` command in a node's user data, as {flag: value or True}."""
    joined = user_data.replace("\\\n", " ")
    lines = [line for line in joined.splitlines() if " ray start " in f" {line.strip()} "]
    commands = [line for line in lines if not line.lstrip().startswith("#")]
    commands = [c for c in commands if "--block" in c]
    assert len(commands) == 1, f"expected one ray start command, found {commands}"
    tokens = shlex.split(commands[0])
    start = tokens.index("ray")
    assert tokens[start + 1] == "start"
    flags: dict[str, Any] = {}
    for token in tokens[start + 2 :]:
        assert token.startswith("--"), f"unexpected positional {token!r} in ray start"
        key, sep, value = token[2:].partition("=")
        flags[key] = value if sep else True
    if flags.get("labels") == "$labels":
        # The pool's labels are assigned above the command; the instance type is added at
        # boot from the metadata service.
        (static,) = re.findall(r"^labels=(.*)$", user_data, flags=re.M)
        flags["labels"] = shlex.split(static)[0] if static else ""
    return flags


@dataclass
class Pool:
    name: str
    launch_template: dict[str, Any]
    asg: dict[str, Any]

    @cached_property
    def user_data(self) -> str:
        return base64.b64decode(self.launch_template["inputs"]["userData"]).decode()

    @cached_property
    def ray_start(self) -> dict[str, Any]:
        return parse_ray_start(self.user_data)

    @property
    def labels(self) -> dict[str, str]:
        raw = self.ray_start.get("labels", "")
        return dict(pair.split("=", 1) for pair in raw.split(",") if pair)

    @property
    def resources(self) -> dict[str, float]:
        return json.loads(self.ray_start.get("resources", "{}"))

    @property
    def market(self) -> str:
        return "spot" if "mixedInstancesPolicy" in self.asg["inputs"] else "on-demand"

    @property
    def instance_types(self) -> list[str]:
        mip = self.asg["inputs"].get("mixedInstancesPolicy")
        if mip:
            return [o["instanceType"] for o in mip["launchTemplate"]["overrides"]]
        return [self.launch_template["inputs"]["instanceType"]]

    @property
    def size(self) -> int:
        """The most nodes the pool may hold (its fixed size without autoscaling)."""
        return int(self.asg["inputs"]["maxSize"])

    @property
    def min_size(self) -> int:
        return int(self.asg["inputs"]["minSize"])

    @property
    def autoscaled(self) -> bool:
        """Sized by Ray's autoscaler: desired capacity is the autoscaler's, not the stack's."""
        return "desiredCapacity" in self.asg.get("ignoreChanges", [])


@dataclass
class Stack:
    resources: list[dict[str, Any]]
    outputs: dict[str, Any]
    invokes: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def of_type(self, typ: str) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["type"] == typ]

    def one(self, typ: str) -> dict[str, Any]:
        found = self.of_type(typ)
        assert len(found) == 1, f"expected one {typ}, found {len(found)}"
        return found[0]

    def by_id(self, rid: str) -> dict[str, Any]:
        found = [r for r in self.resources if r["id"] == rid]
        assert len(found) == 1, rid
        return found[0]

    @cached_property
    def pools(self) -> dict[str, Pool]:
        """Pools keyed by the ASG's raylift:pool tag, joined to the LT the ASG really uses."""
        pools = {}
        for asg in self.of_type(ASG):
            tags = {t["key"]: t["value"] for t in asg["inputs"]["tags"]}
            mip = asg["inputs"].get("mixedInstancesPolicy")
            if mip:
                lt_id = mip["launchTemplate"]["launchTemplateSpecification"]["launchTemplateId"]
            else:
                lt_id = asg["inputs"]["launchTemplate"]["id"]
            pools[tags["raylift:pool"]] = Pool(tags["raylift:pool"], self.by_id(lt_id), asg)
        return pools


def _run(config: dict[str, Any], tmp_dir: Path, *extra_args: str) -> Stack:
    cfg_path = tmp_dir / f"cfg-{abs(hash(json.dumps(config, sort_keys=True)))}.json"
    cfg_path.write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(cfg_path), *extra_args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"program failed under mocks:\n{proc.stderr[-4000:]}")
    data = json.loads(proc.stdout)
    return Stack(
        resources=data["resources"],
        outputs=data["outputs"],
        invokes=data["invokes"],
        warnings=data["warnings"],
    )


class StackRunner:
    """Runs each distinct config once per session."""

    def __init__(self, tmp_dir: Path) -> None:
        self._tmp = tmp_dir
        self._cache: dict[str, Stack] = {}

    def __call__(self, config: dict[str, Any]) -> Stack:
        key = json.dumps(config, sort_keys=True)
        if key not in self._cache:
            self._cache[key] = _run(config, self._tmp)
        return self._cache[key]

    def entrypoint(self, config: dict[str, Any]) -> Stack:
        """Run infra/__main__.py as the Pulumi CLI would (not cached: it is the point)."""
        return _run(config, self._tmp, "--entrypoint")

    def failure(self, config: dict[str, Any]) -> str:
        """Run a config expected to fail; return the error text."""
        with pytest.raises(RuntimeError) as exc:
            _run(config, self._tmp)
        return str(exc.value)


# A config that turns every pool and option on, so one run exercises every code path.
FULL_CONFIG: dict[str, Any] = {
    "aws:region": "us-east-1",
    "raylift:clusterName": "full",
    "raylift:network": {"azCount": 3, "natGateway": "per-az", "interfaceEndpoints": True},
    "raylift:image": {"tag": "trainer-gpu-1.2.3-abcdef0"},
    "raylift:pools": {
        "head": {"instanceTypes": ["m5.2xlarge"]},
        "gpuOnDemand": {"instanceTypes": ["g5.12xlarge"], "size": 2},
        "gpuSpot": {
            "instanceTypes": ["g5.2xlarge", "g5.4xlarge", "g5.8xlarge"],
            "size": 5,
            "labels": {"team": "research"},
        },
        "largeCpuMem": {"instanceTypes": ["g5.24xlarge"], "size": 1},
        "cpu": {"instanceTypes": ["c7i.16xlarge"], "size": 3, "resources": {"ccl": 1}},
    },
}
