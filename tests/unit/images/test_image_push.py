"""ECR login against a loopback stand-in for ECR's token API, and push retries.

The stand-in is a small HTTP server on 127.0.0.1 that speaks the part of ECR's JSON 1.1
protocol boto3 uses for GetAuthorizationToken, and can be told to fail first. boto3 is the
real client (signing, retries, parsing); only the endpoint is local. The Docker engine is
replaced by an object shaped like the SDK's client, since none answers here.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

ACCOUNT = "123456789012"
REGISTRY = f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com"
TARGET = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"
PASSWORD = "eyJwYXlsb2FkIjoic2VjcmV0In0:with:colons"


class FakeEcr(ThreadingHTTPServer):
    """Answers GetAuthorizationToken; `script` holds (status, body) replies to use first."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), EcrHandler)
        self.script: list[tuple[int, dict[str, Any]]] = []
        self.requests: list[dict[str, Any]] = []
        self.token = base64.b64encode(f"AWS:{PASSWORD}".encode()).decode()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class EcrHandler(BaseHTTPRequestHandler):
    server: FakeEcr

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.requests.append(
            {
                "target": self.headers.get("X-Amz-Target"),
                "auth": self.headers.get("Authorization", ""),
                "body": body,
            }
        )
        if self.headers.get("X-Amz-Target") != TARGET:
            status, reply = 400, {"__type": "UnknownOperationException", "message": "?"}
        elif self.server.script:
            status, reply = self.server.script.pop(0)
        else:
            status, reply = (
                200,
                {
                    "authorizationData": [
                        {
                            "authorizationToken": self.server.token,
                            "expiresAt": 1893456000,
                            "proxyEndpoint": f"https://{REGISTRY}",
                        }
                    ]
                },
            )
        payload = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass


@pytest.fixture
def ecr_server() -> Iterator[FakeEcr]:
    server = FakeEcr()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def ecr_client(tool, ecr_server: FakeEcr, monkeypatch):
    """Real boto3 ECR client pointed at the loopback server, with dummy credentials."""
    import boto3

    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_ECR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    session = boto3.session.Session(
        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="dummy", region_name="eu-west-1"
    )

    def make(max_attempts: int = 4):
        return tool.make_ecr_client(
            "eu-west-1", endpoint_url=ecr_server.url, max_attempts=max_attempts, session=session
        )

    return make


# ---- token -> credentials


def test_login_flow_decodes_the_real_token(tool, ecr_server, ecr_client) -> None:
    creds = tool.ecr_credentials(ecr_client(), REGISTRY)
    assert (creds.username, creds.password, creds.registry) == ("AWS", PASSWORD, REGISTRY)
    assert PASSWORD not in repr(creds)
    (request,) = ecr_server.requests
    assert request["target"] == TARGET
    assert request["body"] == {"registryIds": [ACCOUNT]}
    assert request["auth"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/eu-west-1/ecr/aws4_request" in request["auth"]


def test_token_call_is_retried_on_throttling_and_5xx(tool, ecr_server, ecr_client) -> None:
    ecr_server.script = [
        (500, {"__type": "ServerException", "message": "boom"}),
        (400, {"__type": "ThrottlingException", "message": "slow down"}),
    ]
    creds = tool.ecr_credentials(ecr_client(max_attempts=4), REGISTRY)
    assert creds.password == PASSWORD
    assert len(ecr_server.requests) == 3


def test_token_call_gives_up_after_its_attempts(tool, ecr_server, ecr_client) -> None:
    ecr_server.script = [(500, {"__type": "ServerException", "message": "down"})] * 5
    with pytest.raises(tool.UserError, match="ServerException"):
        tool.ecr_credentials(ecr_client(max_attempts=2), REGISTRY)
    assert len(ecr_server.requests) == 2


def test_access_denied_is_one_line_and_not_retried(tool, ecr_server, ecr_client) -> None:
    ecr_server.script = [(400, {"__type": "AccessDeniedException", "message": "no ecr:Get*"})]
    with pytest.raises(tool.UserError) as err:
        tool.ecr_credentials(ecr_client(), REGISTRY)
    assert "AccessDeniedException: no ecr:Get*" in str(err.value)
    assert "\n" not in str(err.value)
    assert len(ecr_server.requests) == 1


def test_malformed_token_is_refused(tool, ecr_server, ecr_client) -> None:
    ecr_server.token = base64.b64encode(b"no-colon-here").decode()
    with pytest.raises(tool.UserError, match="without user:password"):
        tool.ecr_credentials(ecr_client(), REGISTRY)
    ecr_server.token = "%%%not base64%%%"
    with pytest.raises(tool.UserError, match="not base64"):
        tool.ecr_credentials(ecr_client(), REGISTRY)


def test_not_an_ecr_registry(tool, ecr_client) -> None:
    with pytest.raises(tool.UserError, match="not an ECR host"):
        tool.ecr_credentials(ecr_client(), "ghcr.io")


# ---- a stand-in Docker client


class FakeImage:
    def __init__(self, client: FakeClient, ref: str) -> None:
        self.client, self.ref = client, ref

    def tag(self, repository: str, tag: str) -> bool:
        self.client.local.add(f"{repository}:{tag}")
        return True


class FakeClient:
    """Shaped like docker.DockerClient where push_plan touches it: login, images, api.push."""

    def __init__(self, local: set[str], failures: list[Any] | None = None) -> None:
        self.local = set(local)
        self.failures = list(failures or [])
        self.logins: list[dict[str, Any]] = []
        self.pushes: list[tuple[str, str, dict[str, str]]] = []
        self.images = self
        self.api = self

    def get(self, ref: str) -> FakeImage:
        if ref not in self.local:
            raise LookupError(ref)
        return FakeImage(self, ref)

    def login(self, **kwargs: Any) -> dict[str, str]:
        self.logins.append(kwargs)
        return {"Status": "Login Succeeded"}

    def push(self, repository: str, tag: str, stream: bool, decode: bool, auth_config):
        assert stream and decode
        self.pushes.append((repository, tag, auth_config))
        failure = self.failures.pop(0) if self.failures else None
        if isinstance(failure, Exception):
            raise failure
        return self._events(repository, tag, failure)

    @staticmethod
    def _events(repository: str, tag: str, failure: str | None) -> Iterator[dict[str, Any]]:
        yield {"status": f"The push refers to repository [{repository}]"}
        yield {"status": "Pushing", "id": "abc", "progressDetail": {"current": 5, "total": 10}}
        if failure:
            yield {"errorDetail": {"message": failure}, "error": failure}
            return
        digest = "sha256:" + (f"{repository}:{tag}".encode().hex() * 4)[:64]
        yield {"status": f"{tag}: digest: {digest} size: 1234"}
        yield {"progressDetail": {}, "aux": {"Tag": tag, "Digest": digest, "Size": 1234}}


@pytest.fixture
def plan(tool, graph):
    git = tool.GitInfo(sha="0123456789abcdef0123456789abcdef01234567")
    return tool.make_plan(graph, version="0.1.0", git=git, registry=REGISTRY, only="ccl")


def _local(plan) -> set[str]:
    return {ref for image in plan.images for ref in image.refs}


def test_login_is_separate_from_the_token_exchange(tool) -> None:
    creds = tool.RegistryCredentials("AWS", "pw", REGISTRY)
    client = FakeClient(set())
    tool.registry_login(client, creds)
    assert client.logins == [
        {"username": "AWS", "password": "pw", "registry": REGISTRY, "reauth": True}
    ]

    class Refusing(FakeClient):
        def login(self, **kwargs: Any):
            raise RuntimeError("401 unauthorized")

    with pytest.raises(tool.UserError, match=f"docker login to {REGISTRY} failed"):
        tool.registry_login(Refusing(set()), creds)


def test_run_push_logs_in_through_loopback_ecr_and_reports_digests(
    tool, plan, ecr_server, ecr_client
) -> None:
    client = FakeClient(_local(plan))
    pushed = tool.run_push(plan, client, region=None, ecr_factory=lambda region: ecr_client())
    assert client.logins[0]["username"] == "AWS" and client.logins[0]["password"] == PASSWORD
    assert [ref for ref, _ in pushed] == list(plan.images[0].refs)
    assert all(digest.startswith("sha256:") and len(digest) == 71 for _, digest in pushed)
    assert {auth["password"] for _, _, auth in client.pushes} == {PASSWORD}


def test_transient_push_failures_are_retried_with_backoff(tool, plan) -> None:
    client = FakeClient(
        _local(plan),
        failures=[
            "received unexpected HTTP status: 503 Service Unavailable",
            requests.exceptions.ConnectionError("Connection reset by peer"),
        ],
    )
    sleeps: list[float] = []
    pushed = tool.push_plan(plan, client, None, attempts=3, sleep=sleeps.append)
    assert len(pushed) == 2
    assert sleeps == [2.0, 4.0]
    assert len(client.pushes) == 4  # exact tag: 3 tries; moving tag: 1


def test_transient_failures_past_the_budget_fail_in_one_line(tool, plan) -> None:
    client = FakeClient(_local(plan), failures=["net/http: TLS handshake timeout"] * 3)
    with pytest.raises(tool.PushFailed) as err:
        tool.push_plan(plan, client, None, attempts=3, sleep=lambda s: None)
    assert "gave up after 3 attempts" in str(err.value)
    assert "TLS handshake timeout" in str(err.value)


@pytest.mark.parametrize(
    "message",
    [
        "denied: User is not authorized to perform ecr:InitiateLayerUpload",
        "name unknown: The repository with name 'raylift/ccl' does not exist in the registry",
    ],
)
def test_permanent_push_failures_are_not_retried(tool, plan, message: str) -> None:
    client = FakeClient(_local(plan), failures=[message])
    with pytest.raises(tool.PushFailed, match="push of"):
        tool.push_plan(plan, client, None, attempts=5, sleep=lambda s: None)
    assert len(client.pushes) == 1


def test_locally_built_images_get_their_registry_tags(tool, graph, plan) -> None:
    local_plan = tool.make_plan(
        graph, version="0.1.0", git=plan.git, only="ccl"
    )  # built without --registry
    client = FakeClient(set(local_plan.images[0].refs))
    tool.push_plan(plan, client, None, sleep=lambda s: None)
    assert set(plan.images[0].refs) <= client.local


def test_push_refuses_a_missing_image(tool, plan) -> None:
    with pytest.raises(tool.UserError, match="is not a local image"):
        tool.push_plan(plan, FakeClient(set()), None, sleep=lambda s: None)


@pytest.mark.parametrize(
    ("message", "transient"),
    [
        ("received unexpected HTTP status: 502 Bad Gateway", True),
        ("Get https://x/v2/: net/http: request canceled (Client.Timeout exceeded)", True),
        ("toomanyrequests: Rate exceeded", True),
        ("unexpected EOF", True),
        ("denied: Your authorization token has expired", False),
        ("tag invalid: The image tag 'x' already exists and cannot be overwritten", False),
        ("something odd", False),
    ],
)
def test_transient_classification(tool, message: str, transient: bool) -> None:
    assert tool.is_transient(message) is transient


def test_cli_push_dry_run_and_missing_registry(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "tools" / "image.py"
    env = {**os.environ, "PATH": str(tmp_path)}  # no pulumi, no docker: nothing to ask
    env.pop("RAYLIFT_REGISTRY", None)
    sha = "0123456789abcdef0123456789abcdef01234567"
    dry = subprocess.run(
        [sys.executable, str(script), "push", "--dry-run", "--registry", REGISTRY,
         "--git-sha", sha, "--only", "ccl"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert f"{REGISTRY}/raylift/ccl:ccl-0.1.0-0123456" in dry.stdout
    missing = subprocess.run(
        [sys.executable, str(script), "push", "--git-sha", sha],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: no registry: pass --registry")
    assert len(missing.stderr.strip().splitlines()) == 1


def test_immutable_moving_tag_is_a_warning_not_a_failure(tool, plan) -> None:
    class Immutable(FakeClient):
        def push(self, repository, tag, stream, decode, auth_config):
            if tag.endswith("-latest"):
                self.pushes.append((repository, tag, auth_config))
                return self._events(
                    repository,
                    tag,
                    "tag invalid: The image tag 'ccl-latest' already exists in the "
                    "'raylift/ccl' repository and cannot be overwritten because the "
                    "repository is immutable.",
                )
            return super().push(repository, tag, stream, decode, auth_config)

    client = Immutable(_local(plan))
    pushed = tool.push_plan(plan, client, None, sleep=lambda s: None)
    assert [ref for ref, _ in pushed] == [plan.images[0].ref]
    assert len(client.pushes) == 2  # the moving tag was tried once, not retried


def test_immutable_exact_tag_says_what_to_do(tool, plan) -> None:
    message = "tag invalid: The image tag already exists and cannot be overwritten"
    client = FakeClient(_local(plan), failures=[message])
    with pytest.raises(tool.PushFailed, match="already in the registry and its tags are immutable"):
        tool.push_plan(plan, client, None, sleep=lambda s: None)


def test_registry_host_from_infra_repositories_output(tool) -> None:
    output = json.dumps(
        {"base": f"{REGISTRY}/raylift/base", "trainer": f"{REGISTRY}/raylift/trainer"}
    )
    assert tool.registry_from_repositories(output) == REGISTRY
    assert tool.registry_from_repositories("") is None
    assert tool.registry_from_repositories("{}") is None


def test_registry_resolution_order(tool) -> None:
    assert tool.resolve_registry(f"https://{REGISTRY}/", {}, lambda: "pulumi") == REGISTRY
    env = {"RAYLIFT_REGISTRY": "env.example"}
    assert tool.resolve_registry(None, env, lambda: "pulumi") == "env.example"
    assert tool.resolve_registry(None, {}, lambda: "from.pulumi") == "from.pulumi"
    assert tool.resolve_registry(None, {}, lambda: None) is None


def test_push_writes_the_tag_the_stack_reads(tool, graph, tmp_path) -> None:
    """The file `make push` leaves behind names exactly the trainer-gpu tag it pushed, which
    infra/ reads (raylift:image.tagFile) and derives the trainer-cpu tag from."""
    git = tool.GitInfo(sha="abcdef0123456789abcdef0123456789abcdef01")
    full = tool.make_plan(graph, version="0.1.0", git=git, registry=REGISTRY)
    path = tmp_path / "build" / "image-tag"
    assert tool.write_tag_file(full, path) == "trainer-gpu-0.1.0-abcdef0"
    assert path.read_text() == "trainer-gpu-0.1.0-abcdef0\n"
    cpu = next(i for i in full.images if i.name == "trainer-cpu")
    assert cpu.tags[0] == "trainer-cpu-0.1.0-abcdef0"  # what infra/ derives from the file
    # A push without the GPU trainer leaves the file alone.
    only_ccl = tool.make_plan(graph, version="0.2.0", git=git, registry=REGISTRY, only="ccl")
    assert tool.write_tag_file(only_ccl, path) is None
    assert path.read_text() == "trainer-gpu-0.1.0-abcdef0\n"


def test_infra_derives_the_cpu_tag_the_tool_produces(tool, graph) -> None:
    import sys

    sys.path.insert(0, str(tool.REPO_ROOT))
    from infra.image_tags import cpu_tag_for

    git = tool.GitInfo(sha="1234567890abcdef1234567890abcdef12345678")
    tags = {
        i.name: i.tags[0]
        for i in tool.make_plan(graph, version="3.1.4", git=git, registry=REGISTRY).images
    }
    assert cpu_tag_for(tags["trainer-gpu"]) == tags["trainer-cpu"]
