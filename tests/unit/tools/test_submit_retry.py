"""The submit retries the one transient answer a starting head gives ("No available agent
to submit job", HTTP 500) and nothing else. A loopback HTTP server plays the Jobs API so
the real Ray client raises exactly what it raises against a real head."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.jobcli import client


class JobsAPI(BaseHTTPRequestHandler):
    failures_left = 0
    error = "No available agent to submit job, please try again later."
    posts: list[dict] = []  # noqa: RUF012 - reset per test

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/api/version"):
            body = {"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}
            self._send(200, json.dumps(body).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(length) or b"{}")
        type(self).posts.append(req)
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self._send(500, type(self).error.encode(), "text/plain")
            return
        sid = req.get("submission_id")
        self._send(200, json.dumps({"job_id": sid, "submission_id": sid}).encode())


@pytest.fixture
def jobs_api():
    JobsAPI.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), JobsAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _submit(address):
    jobs = client.client_for(address, token="t")
    return client.submit_with_retry(jobs, entrypoint="true", submission_id="raylift-x-1")


def test_transient_no_agent_is_retried_until_it_clears(jobs_api, monkeypatch):
    monkeypatch.setattr(JobsAPI, "failures_left", 2)
    assert _submit(jobs_api) == "raylift-x-1"
    assert len(JobsAPI.posts) == 3
    assert {p["submission_id"] for p in JobsAPI.posts} == {"raylift-x-1"}


def test_never_clearing_is_one_clear_error_within_the_bound(jobs_api, monkeypatch):
    monkeypatch.setattr(JobsAPI, "failures_left", 10**6)
    monkeypatch.setattr(client, "SUBMIT_RETRY_S", 2.0)
    with pytest.raises(client.AgentNotReady, match="did not become available in 2s"):
        _submit(jobs_api)
    assert 1 <= len(JobsAPI.posts) <= 4  # a loaded machine may fit fewer tries in 2 s


def test_other_errors_are_not_retried(jobs_api, monkeypatch):
    monkeypatch.setattr(JobsAPI, "failures_left", 1)
    monkeypatch.setattr(JobsAPI, "error", "Traceback ... ValueError: bad runtime_env")
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        _submit(jobs_api)
    assert len(JobsAPI.posts) == 1
