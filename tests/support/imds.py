"""A fake EC2 instance metadata service (IMDSv2 only) on 127.0.0.1, for the node agent's tests.

It behaves like the real one where the agent can tell: a session token comes from
`PUT /latest/api/token` with a TTL header (1..21600 s), every GET without a valid,
unexpired token is answered 401, and the two notice paths answer 404 until a test
triggers them. Every request is logged, so a test can assert what the agent asked and how.
It can also go away for a while (`down()`), as the real service does under load or while an
instance is being reconfigured.

`FakeAutoScaling` is the Auto Scaling API's one call the agent makes
(CompleteLifecycleAction, Query protocol), for boto3 pointed at it with
AWS_ENDPOINT_URL_AUTO_SCALING.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOST = "127.0.0.1"
TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
MAX_TTL_S = 21600


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    status: int
    token: str | None  # the session token header as sent (None: no header)


def _iso(when: datetime) -> str:
    """The notices' time format: `2026-11-22T21:07:00Z` (UTC, whole seconds)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeImds:
    def __init__(self, instance_id: str = "i-0fake0000000000001") -> None:
        self.instance_id = instance_id
        self.requests: list[Request] = []
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        self._spot: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._target_state = "InService"
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ---- lifecycle

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> FakeImds:
        # Port 0 the first time; the same port again after down(), as the real service keeps
        # its address.
        server = ThreadingHTTPServer((HOST, self.port), self._handler_class())
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="fake-imds", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Refuse connections (nothing listens) inside the block; serve again after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def __enter__(self) -> FakeImds:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what a test controls

    def trigger_spot(self, seconds_from_now: float, action: str = "terminate") -> datetime:
        """Serve a spot interruption notice; returns its time (whole seconds, as AWS's)."""
        when = (datetime.now(UTC) + timedelta(seconds=seconds_from_now)).replace(microsecond=0)
        with self._lock:
            self._spot = {"action": action, "time": _iso(when)}
        return when

    def trigger_rebalance(self) -> datetime:
        when = datetime.now(UTC).replace(microsecond=0)
        with self._lock:
            self._rebalance = {"noticeTime": _iso(when)}
        return when

    def trigger_termination(self) -> None:
        """The Auto Scaling group starts ending this instance (it waits on the drain hook)."""
        with self._lock:
            self._target_state = "Terminated"

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (as after a TTL runs out)."""
        with self._lock:
            self._tokens.clear()

    def requests_to(self, path: str, method: str = "GET") -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == path and r.method == method]

    # ---- the HTTP side

    def _token_valid(self, token: str | None) -> bool:
        with self._lock:
            expiry = self._tokens.get(token or "")
        return expiry is not None and time.monotonic() < expiry

    def _answer(self, method: str, path: str, headers) -> tuple[int, str]:
        if method == "PUT":
            if path != TOKEN_PATH:
                return 405, ""
            try:
                ttl = int(headers.get(TTL_HEADER, ""))
            except ValueError:
                return 400, ""
            if not 1 <= ttl <= MAX_TTL_S:
                return 400, ""
            token = secrets.token_urlsafe(32)
            with self._lock:
                self._tokens[token] = time.monotonic() + ttl
            return 200, token
        if not self._token_valid(headers.get(TOKEN_HEADER)):
            return 401, ""
        with self._lock:
            spot, rebalance = self._spot, self._rebalance
        if path == SPOT_PATH:
            return (200, json.dumps(spot)) if spot else (404, "")
        if path == REBALANCE_PATH:
            return (200, json.dumps(rebalance)) if rebalance else (404, "")
        if path == INSTANCE_ID_PATH:
            return 200, self.instance_id
        if path == LIFECYCLE_PATH:
            with self._lock:
                return 200, self._target_state
        return 404, ""

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, body = fake._answer(method, self.path, self.headers)
                with fake._lock:
                    fake.requests.append(
                        Request(method, self.path, status, self.headers.get(TOKEN_HEADER))
                    )
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def log_message(self, format: str, *args: object) -> None:
                pass  # the request log above is what tests read

        return Handler


class FakeAutoScaling:
    """Answers CompleteLifecycleAction and records each call (its form fields, and when)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://{HOST}:{self._server.server_address[1]}"

    def __enter__(self) -> FakeAutoScaling:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                from urllib.parse import parse_qsl

                length = int(self.headers.get("Content-Length") or 0)
                form = dict(parse_qsl(self.rfile.read(length).decode()))
                fake.calls.append((time.time(), form))
                action = form.get("Action", "")
                body = (
                    f'<{action}Response xmlns="http://autoscaling.amazonaws.com/doc/2011-01-01/">'
                    f"<{action}Result/><ResponseMetadata><RequestId>fake</RequestId>"
                    f"</ResponseMetadata></{action}Response>"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-asg", daemon=True
        ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@contextlib.contextmanager
def node_agent(
    imds: FakeImds, node_id: str, gcs_address: str, log_path: Path, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m trainer agent` for one Ray node against this metadata service (polling every
    0.5 s, draining with 10 s of a notice's deadline left), its output in `log_path`, `env`
    added to this process's environment; ended when the block ends."""
    argv = [sys.executable, "-m", "trainer", "agent", "--imds-endpoint", imds.endpoint]
    argv += ["--interval", "0.5", "--margin", "10", "--node-id", node_id]
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            [*argv, "--gcs-address", gcs_address],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            yield agent
        finally:
            agent.terminate()
            agent.wait(timeout=30)
