"""Where the cluster is, and how to reach it without opening a port.

Order: `--address`, else `RAY_ADDRESS`, else the `infra/` stack (when the `pulumi` CLI is
on PATH and a stack is selected), else the local cluster that `tools/localcluster.py`
started. A stack's Jobs API is reached through an SSM port forward that this module opens
as a subprocess and closes at exit: Ray's Jobs API runs arbitrary code, so it is never
exposed to a network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.errors import UserError

log = logging.getLogger("raylift.submit")
ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
FORWARD_READY_S = 60.0


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None  # None: RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH, read at request time
    source: str
    local: bool  # a cluster on this machine: its files are the job's files


def is_loopback(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname
    return host in ("127.0.0.1", "localhost", "::1")


def local_cluster_file() -> Path:
    """Where `python tools/localcluster.py` records the cluster it runs (while it runs)."""
    return Path(
        os.environ.get("RAYLIFT_LOCAL_CLUSTER_FILE") or ROOT / "build" / "localcluster.json"
    )


def write_local_cluster_file(address: str, token_path: Path) -> Path:
    path = local_cluster_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"address": address, "token_path": str(token_path), "pid": os.getpid()}
    path.write_text(json.dumps(record))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_cluster() -> Target | None:
    path = local_cluster_file()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(record.get("pid", 0))):
        log.debug("%s names a local cluster whose process is gone", path)
        return None
    token_path = Path(record["token_path"])
    token = token_path.read_text().strip() if token_path.exists() else None
    return Target(record["address"], token, f"local cluster ({path})", local=True)


def _stack_outputs() -> dict[str, Any] | None:
    """The selected infra stack's outputs, or None when there is no usable stack here."""
    if shutil.which("pulumi") is None or not INFRA.is_dir():
        return None
    try:
        res = subprocess.run(
            ["pulumi", "stack", "output", "--json"],
            cwd=INFRA,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("pulumi stack output: %s", exc)
        return None
    if res.returncode != 0:
        log.debug("pulumi stack output failed: %s", res.stderr.strip()[-300:])
        return None
    try:
        return json.loads(res.stdout or "{}")
    except ValueError:
        return None


def _aws(*args: str) -> str:
    try:
        res = subprocess.run(["aws", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError(
            "the infra stack's Jobs API is reached through SSM, which needs the `aws` CLI "
            "and its session-manager-plugin on PATH"
        ) from None
    if res.returncode != 0:
        err = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`aws {' '.join(args[:2])}` failed: {err}")
    return res.stdout.strip()


_REGION = re.compile(r"--region\s+(\S+)")
_ASG = re.compile(r"groupName,Values=([^\s'\"]+)")
_PORT = re.compile(r'"portNumber":\["(\d+)"\]')


def parse_port_forward(command: str) -> tuple[str, str, int]:
    """(region, head auto scaling group, dashboard port) from the stack's
    `jobsApiPortForward` output, the command the infra README tells users to run."""
    region, asg, port = _REGION.search(command), _ASG.search(command), _PORT.search(command)
    if not (region and asg and port):
        raise UserError(
            "the infra stack's jobsApiPortForward output is not in the expected form; "
            "open the port forward yourself and pass --address"
        )
    return region.group(1), asg.group(1), int(port.group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortForward:
    """`aws ssm start-session` to the head's dashboard port, on a free local port; closed
    (with the session-manager-plugin it starts) by `close()`."""

    def __init__(self, region: str, instance: str, remote_port: int):
        self.local_port = free_port()
        params = {"portNumber": [str(remote_port)], "localPortNumber": [str(self.local_port)]}
        cmd = [
            "aws",
            "ssm",
            "start-session",
            "--region",
            region,
            "--target",
            instance,
            "--document-name",
            "AWS-StartPortForwardingSession",
            "--parameters",
            json.dumps(params, separators=(",", ":")),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group: close() ends the plugin too
        )

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def wait_ready(self, timeout: float = FORWARD_READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip() or "no output"
                raise UserError(
                    f"the SSM port forward to the head ended at once: {err.splitlines()[-1]}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.local_port), timeout=1),
            ):
                return
            time.sleep(0.1)
        self.close()
        raise UserError(f"the SSM port forward did not open 127.0.0.1:{self.local_port} in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _from_stack(outputs: dict[str, Any], stack: contextlib.ExitStack) -> Target:
    command = outputs.get("jobsApiPortForward")
    if not command:
        raise UserError(
            "the infra stack has no head node yet (its jobsApiPortForward output is empty); "
            "run `make push`, then `pulumi up` in infra/"
        )
    region, asg, remote_port = parse_port_forward(command)
    instance = _aws(
        "ec2",
        "describe-instances",
        "--region",
        region,
        "--filters",
        f"Name=tag:aws:autoscaling:groupName,Values={asg}",
        "Name=instance-state-name,Values=running",
        "--query",
        "Reservations[0].Instances[0].InstanceId",
        "--output",
        "text",
    )
    if not instance or instance == "None":
        raise UserError(f"no running head instance in auto scaling group {asg} ({region})")
    token = None
    secret = outputs.get("rayAuthTokenSecretArn")
    if secret and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        token = _aws(
            "secretsmanager",
            "get-secret-value",
            "--region",
            region,
            "--secret-id",
            secret,
            "--query",
            "SecretString",
            "--output",
            "text",
        )
    forward = PortForward(region, instance, remote_port)
    stack.callback(forward.close)
    log.info("opening an SSM port forward to the head (%s) …", instance)
    forward.wait_ready()
    # 127.0.0.1, but the far end of a tunnel: the cluster's files are not this machine's.
    return Target(forward.address, token, f"infra stack (SSM to {instance})", local=False)


def resolve(address: str | None, stack: contextlib.ExitStack) -> Target:
    """The cluster to talk to; anything opened to reach it is closed by `stack`."""
    if address:
        return Target(address, None, "--address", is_loopback(address))
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        return Target(address, None, "RAY_ADDRESS", is_loopback(address))
    outputs = _stack_outputs()
    if outputs is not None:
        return _from_stack(outputs, stack)
    local = _local_cluster()
    if local is not None:
        return local
    raise UserError(
        "no Ray cluster found: pass --address, set RAY_ADDRESS, select an infra/ stack "
        "(pulumi), or start one with `python tools/localcluster.py`"
    )
