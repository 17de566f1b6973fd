"""A Ray cluster on 127.0.0.1 whose head runs Ray's real autoscaler v2 with our node provider
against moto's AWS server, and a boot simulator standing in for EC2 booting the instances.

Isolated from any other Ray on the machine: its own temp folder per node, its own GCS and
client ports, nothing started on Ray's fixed default ports, and stopped by killing only the
process groups (and leftovers naming its folder) that it started: never `ray stop`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.aws import HOST, aws_env, clients, live_instances
from tools.localcluster import RAY_START_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
START_TRIES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


ISOLATED_HOME = Path(tempfile.mkdtemp(prefix="rl-autoscale-home-"))
"""HOME for this cluster's processes: Ray reads a token from ~/.ray/auth_token, and one
left there (by any Ray cluster with token auth on this machine) put the head in token mode
while its job had none: every autoscaling test failed on a machine that had one."""


def node_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))}
    env.update(aws_env())
    env.update(
        {
            "HOME": str(ISOLATED_HOME),
            "PYTHONPATH": str(ROOT),  # Ray's monitor imports trainer.autoscaling.provider
            "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
            "RAY_USAGE_STATS_ENABLED": "0",
            "GLOO_SOCKET_IFNAME": "lo",
            **extra,
        }
    )
    return env


def _kill_tree(proc: subprocess.Popen, mark: str) -> None:
    """The node's process group, then anything still naming its own folder."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and mark in " ".join(p.info.get("cmdline") or []):
            with contextlib.suppress(psutil.Error):
                p.kill()


def start_ray(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own; returns once Ray says it started.

    A start whose raylet missed Ray's fixed 30 s to register (seen twice on a loaded 2-core
    machine, the head's and a booted node's) is ended whole, every process naming its
    --temp-dir, and made again, START_TRIES times at most; as a node's systemd unit restarts
    a failed `ray start`. Any other failure is raised at once."""
    mark = next(a.split("=", 1)[1] for a in args if a.startswith("--temp-dir="))
    for attempt in range(1, START_TRIES + 1):
        out = log.open("w")
        proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in (text := log.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            return proc
        _kill_tree(proc, mark)
        if RAY_START_TIMEOUT not in text or attempt == START_TRIES:
            raise RuntimeError(f"ray start failed:\n{text[-3000:]}")
        log_ = logging.getLogger(__name__)
        log_.warning("ray start %d/%d missed Ray's 30 s: again", attempt, START_TRIES)
    raise AssertionError("START_TRIES must be at least 1")


def launch_time(endpoint: str, instance: str) -> float:
    """When EC2 (moto) created the instance: polling the groups under load notices it late."""
    _, ec2 = clients(endpoint)
    [reservation] = ec2.describe_instances(InstanceIds=[instance])["Reservations"]
    return reservation["Instances"][0]["LaunchTime"].timestamp()


@dataclass
class Event:
    t: float
    kind: str  # launched (EC2's launch time) | booted | ended (when the simulator saw it go)
    pool: str
    instance: str


@dataclass
class BootSimulator:
    """One local Ray node per instance of a watched group, as the node's systemd unit would
    start it (RAY_CLOUD_INSTANCE_ID, RAY_NODE_TYPE_NAME, the pool's resources and labels);
    stopped when its instance leaves the group. Pools in `never_boot` get instances whose
    Ray never comes up (a launch that never delivers a node)."""

    endpoint: str
    groups: dict[str, str]
    gcs: str
    shapes: dict[str, dict[str, Any]]
    root: Path
    never_boot: set[str] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        for instance, proc in list(self.nodes.items()):
            _kill_tree(proc, str(self.root / instance))

    def _run(self) -> None:
        seen: dict[str, str] = {}
        while not self._stop.is_set():
            try:
                live = {
                    i: pool
                    for pool, name in self.groups.items()
                    for i in live_instances(self.endpoint, name)
                }
            except Exception as exc:  # moto busy: try again
                self.errors.append(repr(exc))
                self._stop.wait(0.5)
                continue
            for instance, pool in live.items():
                if instance not in seen:
                    seen[instance] = pool
                    self.events.append(
                        Event(launch_time(self.endpoint, instance), "launched", pool, instance)
                    )
                    if pool not in self.never_boot:
                        self._boot(instance, pool)
            for instance, pool in list(seen.items()):
                if instance not in live and not any(
                    e.instance == instance and e.kind == "ended" for e in self.events
                ):
                    self.events.append(Event(time.time(), "ended", pool, instance))
                    proc = self.nodes.pop(instance, None)
                    if proc is not None:
                        _kill_tree(proc, str(self.root / instance))
            self._stop.wait(0.5)

    def _boot(self, instance: str, pool: str) -> None:
        shape = self.shapes[pool]
        folder = self.root / instance
        folder.mkdir()
        resources = {k: v for k, v in shape["resources"].items() if k != "CPU"}
        labels = ",".join(f"{k}={v}" for k, v in sorted(shape["labels"].items()))
        try:
            self.nodes[instance] = start_ray(
                [
                    f"--address={self.gcs}",
                    f"--node-ip-address={HOST}",
                    f"--num-cpus={int(shape['resources']['CPU'])}",
                    f"--resources={json.dumps(resources)}",
                    f"--labels={labels}",
                    "--dashboard-agent-listen-port=0",
                    "--object-store-memory=80000000",
                    f"--temp-dir={folder}",
                ],
                node_env({"RAY_CLOUD_INSTANCE_ID": instance, "RAY_NODE_TYPE_NAME": pool}),
                self.root / f"{instance}.log",
            )
            self.events.append(Event(time.time(), "booted", pool, instance))
        except RuntimeError as exc:
            self.errors.append(str(exc))


def local_root() -> Path:
    """Short (Ray's socket paths must fit 107 bytes), and this test's own."""
    return Path(tempfile.mkdtemp(prefix="rla-", dir="/tmp"))
