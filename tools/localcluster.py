"""A local multi-node Ray cluster on 127.0.0.1 with the Jobs API and token authentication.

Each node is a real raylet with its own CPUs, custom resources and labels, started through
`ray.cluster_utils.Cluster` with `node_ip_address="127.0.0.1"`. (`ray start` swaps a
loopback address for the machine's outward one, and with that swap turned off it refuses
to add worker nodes, so the CLI cannot keep a multi-node cluster on loopback.) Stopping
the cluster ends exactly its own processes; other Ray instances on the machine are
untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("raylift.localcluster")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


SOCKET_PATH_MAX = 107
"""AF_UNIX path limit on Linux; Ray refuses to start when a socket path is longer."""
_SESSION_SUFFIX = len(
    "/rl-xxxxxxxx/ray/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store"
)


RAY_START_TIMEOUT = "timed out during startup"
"""What Ray's node start raises when a raylet did not register within its fixed 30 s."""
NODE_TRIES = 3
NODE_MARK_ENV = "RAYLIFT_LOCAL_NODE"
"""Set in one node start's raylet environment (its workers and agents inherit it), so that
a start that failed can be ended without touching any other node."""


def kill_marked(mark: str) -> int:
    """SIGKILL every process whose environment has NODE_MARK_ENV=mark; returns how many."""
    import psutil

    needle = f"{NODE_MARK_ENV}={mark}"
    ended = 0
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            if f"{NODE_MARK_ENV}={env.get(NODE_MARK_ENV)}" == needle and p.pid != os.getpid():
                p.kill()
                ended += 1
    return ended


def _short_temp_root() -> str:
    """The cluster's folder lives under TMPDIR (so a fresh TMPDIR means a fresh cluster),
    unless Ray's deepest socket path inside it would pass the AF_UNIX limit: then /tmp."""
    root = tempfile.gettempdir()
    return root if len(root) + _SESSION_SUFFIX <= SOCKET_PATH_MAX else "/tmp"


def _forget_cached_token() -> None:
    """Ray's C++ side reads the auth token once per process and keeps it: a second cluster
    started in the same process (a start made again after a miss, a test's own head after
    the session's cluster) would be sent the first one's token, and its GCS answers
    InvalidAuthToken. Make this process read RAY_AUTH_TOKEN_PATH again."""
    from ray._raylet import AuthenticationTokenLoader

    AuthenticationTokenLoader.instance().reset_cache()


class LocalCluster:
    def __init__(
        self,
        num_cpus: int = 2,
        head_labels: dict[str, str] | None = None,
        token: str | None = None,
        dashboard_port: int = 0,
    ):
        """`token` and `dashboard_port` let a replacement head come back at the same
        address with the same credentials (a head restart); by default both are new."""
        self.num_cpus = num_cpus
        self.head_labels = dict(head_labels or {})
        self.token = token or secrets.token_hex(32)
        self.root: Path | None = None
        self.temp_dir: Path | None = None
        self.dashboard_port = dashboard_port
        self._cluster: Any = None
        self._saved_env: dict[str, str | None] = {}
        self.worker_nodes: list[tuple[Any, dict[str, str]]] = []  # (Ray node, its labels)

    @property
    def address(self) -> str:
        return self._cluster.address

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def token_path(self) -> Path:
        assert self.root is not None
        return self.root / "auth_token"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _set_env(self) -> None:
        """Node processes inherit this process's environment."""
        env = {
            # Token authentication, as on the real cluster: the Jobs API and every Ray
            # server answer only to this cluster's own token.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray swaps 127.0.0.1 for the machine's outward IP whenever a process connects
            # (drivers, dashboard agents) unless it is in single-machine mode; keep every
            # address on loopback. (This mode only blocks `ray start` worker nodes, which
            # this class does not use.)
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # gloo picks its interface from the hostname, which resolves to the outward
            # address; pin its sockets to loopback like everything else here.
            "GLOO_SOCKET_IFNAME": "lo",
            # Jobs run `python -m trainer`: make that this interpreter.
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
            # The cluster writes its address to `<RAY_TMPDIR>/ray/ray_current_cluster`,
            # and the job supervisor reads it from `<node temp_dir>/ray_current_cluster`
            # to give each job driver its GCS address. With both pointing at this
            # cluster's own folder, a driver always finds its own cluster (never another
            # one running on the machine, never a stale file an earlier run left).
            "RAY_TMPDIR": str(self.root),
        }
        for key, value in env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ.pop(key, None)
        # Ray reads RAY_AUTH_MODE into its config when first imported; re-read it so this
        # process (which starts the GCS and talks to it) uses token mode too. Ray 2.60's
        # own `ray start` does the same after enabling token auth.
        from ray._raylet import Config

        Config.initialize("")
        _forget_cached_token()

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        if "ray" in sys.modules:
            _forget_cached_token()

    def start(self, timeout: float = 180.0) -> LocalCluster:
        self.root = Path(tempfile.mkdtemp(prefix="rl-", dir=_short_temp_root()))
        self.temp_dir = self.root / "ray"
        self.temp_dir.mkdir()
        self.token_path.write_text(self.token)
        self.token_path.chmod(0o600)
        # Before Ray's first import in this process: it reads the loopback-only setting
        # then, and a process that imported it earlier reaches the cluster through the
        # machine's outward address instead of 127.0.0.1 (a driver here then hangs).
        self._set_env()
        from ray.cluster_utils import Cluster

        self.dashboard_port = self.dashboard_port or free_port()
        try:
            self._cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "node_ip_address": HOST,
                    "num_cpus": self.num_cpus,
                    "include_dashboard": True,
                    "dashboard_host": HOST,
                    "dashboard_port": self.dashboard_port,
                    # The head's agent would take Ray's fixed default port (52365); a
                    # second cluster on the machine (a test beside `make demo`, two users)
                    # then never gets its job agent, and no job can be submitted. A port
                    # picked here and bound later can be taken in between (the agent then
                    # serves no HTTP and never registers): 0 lets the agent bind a free
                    # port itself, and it registers the port it got in the GCS, where
                    # `wait_ready` and the dashboard look it up.
                    "dashboard_agent_listen_port": 0,
                    "temp_dir": str(self.temp_dir),
                    "labels": self.head_labels,
                    "object_store_memory": 256 * 1024 * 1024,
                },
                shutdown_at_exit=True,
            )
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(
        self,
        num_cpus: int = 1,
        labels: dict[str, str] | None = None,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
    ) -> Any:
        """`env`: variables only this node's raylet (and so its workers) sees, e.g. to give
        one node a credential or a mount path the others do not have.

        Ray gives a new raylet a fixed 30 s to register (ray/_private/node.py, no setting);
        on a loaded 2-core machine a node added in the middle of a drill has missed it. A
        start that misses it is ended whole, every process that carries its mark (the
        raylet and what it spawned), so no late registration adds a node twice; then it
        is started again, NODE_TRIES times at most. Any other error is raised at once."""
        for attempt in range(1, NODE_TRIES + 1):
            mark = secrets.token_hex(8)
            try:
                node = self._cluster.add_node(
                    node_ip_address=HOST,
                    num_cpus=num_cpus,
                    labels=dict(labels or {}),
                    resources=dict(resources or {}),
                    object_store_memory=128 * 1024 * 1024,
                    env_vars={**(env or {}), NODE_MARK_ENV: mark},
                )
            except Exception as exc:
                if RAY_START_TIMEOUT not in str(exc) or attempt == NODE_TRIES:
                    raise
                ended = kill_marked(mark)
                log.warning(
                    "Ray node start %d/%d missed Ray's 30 s to register; ended its %d "
                    "processes, starting it again",
                    attempt,
                    NODE_TRIES,
                    ended,
                )
                continue
            self.worker_nodes.append((node, dict(labels or {})))
            return node
        raise AssertionError("NODE_TRIES must be at least 1")

    def kill_node(self, node: Any) -> None:
        """A node lost at once (its raylet and every worker on it), as a reclaimed spot
        instance or a dead machine: no graceful shutdown."""
        self._cluster.remove_node(node, allow_graceful=False)
        self.worker_nodes = [(n, lab) for n, lab in self.worker_nodes if n is not node]

    def _get(self, path: str) -> Any:
        req = urllib.request.Request(self.dashboard_url + path, headers=self.auth_headers)
        with urllib.request.urlopen(req, timeout=3) as r:
            return json.loads(r.read() or b"null")

    def wait_ready(self, timeout: float) -> None:
        """Ready means a job can really be submitted: the Jobs API answers (with the
        token) and the head node's job agent has registered and answers too. The Jobs API
        comes up first; a submit before the agent registers fails with "No available
        agent to submit job" once the dashboard's own 10 s wait runs out."""
        deadline = time.monotonic() + timeout
        last: Exception | str | None = None
        while time.monotonic() < deadline:
            try:
                self._get("/api/jobs/")
                agent = self._job_agent_url()
                if agent is None:
                    last = "the head node's job agent has not registered yet"
                elif self._answers(agent):
                    return
                else:
                    last = f"the job agent at {agent} does not answer yet"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = exc
            time.sleep(0.3)
        raise TimeoutError(
            f"Ray Jobs API at {self.dashboard_url} not ready after {timeout:.0f}s: {last}"
        )

    def _job_agent_url(self) -> str | None:
        """The head's job agent address, as the dashboard itself looks it up in the GCS."""
        from ray._private import ray_constants
        from ray.dashboard import consts

        gcs = self._cluster.head_node.get_gcs_client()
        node_id = gcs.internal_kv_get(
            ray_constants.KV_HEAD_NODE_ID_KEY, namespace=ray_constants.KV_NAMESPACE_JOB
        )
        if not node_id:
            return None
        info = gcs.internal_kv_get(
            f"{consts.DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{node_id.decode()}".encode(),
            namespace=ray_constants.KV_NAMESPACE_DASHBOARD,
        )
        if not info:
            return None
        ip, http_port, _grpc = json.loads(info.decode())
        return f"http://{ip}:{http_port}"

    def _answers(self, url: str) -> bool:
        """Any HTTP answer (even 404 for a job that does not exist) means it is serving."""
        req = urllib.request.Request(
            url + "/api/job_agent/jobs/raylift-readiness-probe/logs", headers=self.auth_headers
        )
        try:
            with urllib.request.urlopen(req, timeout=3):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            return False

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Block until `count` nodes are alive (the dashboard's node list)."""
        deadline = time.monotonic() + timeout
        alive = 0
        while time.monotonic() < deadline:
            try:
                summary = self._get("/nodes?view=summary").get("data", {}).get("summary", [])
                alive = sum(1 for n in summary if n.get("raylet", {}).get("state") == "ALIVE")
                if alive >= count:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"only {alive} of {count} Ray nodes alive after {timeout:.0f}s")

    def stop(self) -> None:
        if self._cluster is not None:
            try:
                self._cluster.shutdown()
            finally:
                self._cluster = None
        self._kill_leftovers()
        self._restore_env()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Job drivers and workers that outlived their raylet still name our session dir."""
        if self.root is None:
            return
        import psutil

        mark = str(self.root)
        for p in psutil.process_iter(["cmdline"]):
            if p.pid != os.getpid() and mark in " ".join(p.info.get("cmdline") or []):
                with contextlib.suppress(psutil.Error):
                    p.kill()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="Run a local Ray cluster on 127.0.0.1 until Ctrl-C.")
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    from tools.jobcli.cluster import write_local_cluster_file

    with LocalCluster(num_cpus=args.num_cpus, head_labels={"large_cpu_mem": "true"}) as c:
        # tools/submit.py finds this cluster here when no address is given.
        record = write_local_cluster_file(c.dashboard_url, c.token_path)
        try:
            print(f"RAY_ADDRESS={c.dashboard_url}", flush=True)
            print(f"RAY_AUTH_TOKEN_PATH={c.token_path}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
        finally:
            record.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
