"""Pushing: ECR login (plain boto3), pushes through any object shaped like the Docker SDK's
client, retried with tenacity on transient errors only, and the tag file infra/ reads."""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tools.imagetool.buildplan import ImageBuild, Plan, image_ref, normalize_registry
from tools.imagetool.console import stderr_console
from tools.imagetool.errors import PushFailed, TransientError, UserError
from tools.imagetool.graph import REPO_ROOT

log = logging.getLogger("raylift.image")
T = TypeVar("T")

REGISTRY_ENV = "RAYLIFT_REGISTRY"
PULUMI_REPOSITORIES_OUTPUT = "repositories"
# `push` writes the exact tag of the GPU trainer image it pushed here; infra/ reads it
# (raylift:image.tagFile, default ../build/image-tag) and derives the CPU tag from it.
TAG_FILE = REPO_ROOT / "build" / "image-tag"
TAG_FILE_IMAGE = "trainer-gpu"

ECR_RE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$"
)


@dataclass(frozen=True)
class RegistryCredentials:
    """Short-lived registry login (ECR tokens last 12 hours). The password never prints."""

    username: str
    password: str = field(repr=False)
    registry: str
    expires_at: Any = None

    def auth_config(self) -> dict[str, str]:
        """The per-request auth the SDK's push accepts: nothing is written to ~/.docker."""
        return {"username": self.username, "password": self.password}


def decode_authorization_token(token: str) -> tuple[str, str]:
    """ECR's token is base64("user:password"); split at the first colon only."""
    try:
        decoded = base64.b64decode(token, validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise UserError("ECR returned an authorization token that is not base64 text") from None
    username, sep, password = decoded.partition(":")
    if not sep or not username or not password:
        raise UserError("ECR returned an authorization token without user:password")
    return username, password


def make_ecr_client(
    region: str, *, endpoint_url: str | None = None, max_attempts: int = 5, session: Any = None
) -> Any:
    """boto3 ECR client with standard-mode retries (throttling and 5xx are retried by boto3)."""
    import boto3
    from botocore.config import Config

    config = Config(
        # total_max_attempts counts the first call; botocore's max_attempts would not.
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=10,
        read_timeout=30,
    )
    session = session or boto3.session.Session()
    return session.client("ecr", region_name=region, endpoint_url=endpoint_url, config=config)


def ecr_credentials(ecr: Any, registry: str) -> RegistryCredentials:
    """Exchange AWS credentials for a registry login for `registry` (an ECR host)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    match = ECR_RE.match(registry)
    if not match:
        raise UserError(
            f"registry {registry!r} is not an ECR host (<account>.dkr.ecr.<region>.amazonaws.com)"
        )
    try:
        response = ecr.get_authorization_token(registryIds=[match["account"]])
    except NoCredentialsError:
        raise UserError(
            "no AWS credentials found: set AWS_PROFILE or run `aws sso login` and retry"
        ) from None
    except ClientError as exc:
        error = exc.response.get("Error", {})
        raise UserError(
            f"ECR GetAuthorizationToken for {registry} failed: {error.get('Code', '?')}: "
            f"{error.get('Message', exc)}"
        ) from None
    except BotoCoreError as exc:
        raise UserError(f"ECR GetAuthorizationToken for {registry} failed: {exc}") from None
    data = (response.get("authorizationData") or [None])[0]
    if not data or "authorizationToken" not in data:
        raise UserError(f"ECR returned no authorization data for {registry}")
    username, password = decode_authorization_token(data["authorizationToken"])
    endpoint = normalize_registry(data.get("proxyEndpoint") or registry)
    return RegistryCredentials(username, password, endpoint, data.get("expiresAt"))


def registry_login(client: Any, creds: RegistryCredentials) -> None:
    """Check the credentials against the registry once, before any push starts."""
    try:
        client.login(
            username=creds.username,
            password=creds.password,
            registry=creds.registry,
            reauth=True,
        )
    except Exception as exc:
        raise UserError(f"docker login to {creds.registry} failed: {exc}") from None


PERMANENT = re.compile(
    r"denied|unauthorized|not authorized|name unknown|repository .* not exist|"
    r"does not exist|manifest invalid|tag invalid|immutable",
    re.IGNORECASE,
)
TRANSIENT = re.compile(
    r"timeout|timed out|connection reset|connection refused|broken pipe|\bEOF\b|"
    r"too ?many ?requests|throttl|service unavailable|bad gateway|gateway time|"
    r"internal server error|\b50[0234]\b|tls handshake|temporar",
    re.IGNORECASE,
)


IMMUTABLE_TAG = re.compile(r"immutable|cannot be overwritten", re.IGNORECASE)


def is_transient(message: str) -> bool:
    """Retry network and server hiccups; never retry auth or missing-repository errors."""
    if PERMANENT.search(message):
        return False
    return bool(TRANSIENT.search(message))


def push_once(
    api: Any,
    repository: str,
    tag: str,
    auth_config: Mapping[str, str] | None,
    on_event: Callable[[dict[str, Any]], None] = lambda event: None,
) -> str:
    """Push one tag; return the manifest digest the registry reported."""
    digest = None
    try:
        stream = api.push(
            repository, tag=tag, stream=True, decode=True, auth_config=dict(auth_config or {})
        )
        for event in stream:
            message = event.get("error") or (event.get("errorDetail") or {}).get("message")
            if message:
                if is_transient(message):
                    raise TransientError(message)
                raise PushFailed(f"push of {repository}:{tag} failed: {message}")
            aux = event.get("aux") or {}
            if aux.get("Digest"):
                digest = aux["Digest"]
            on_event(event)
    except (TransientError, PushFailed):
        raise
    except Exception as exc:  # requests' ConnectionError/ReadTimeout, docker's APIError...
        message = f"{type(exc).__name__}: {exc}"
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if (status is not None and status >= 500) or is_transient(message):
            raise TransientError(message) from exc
        raise PushFailed(f"push of {repository}:{tag} failed: {message}") from exc
    if not digest:
        raise PushFailed(f"push of {repository}:{tag} ended without a digest from the registry")
    return digest


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = 5,
    base_delay: float = 2.0,
    max_delay: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call fn, retrying TransientError with exponential backoff (tenacity); other errors pass
    through at once, and the last transient one becomes a one-line PushFailed."""
    import tenacity  # the tools extra, like the Docker SDK and boto3 that pushing needs

    def warn(state: tenacity.RetryCallState) -> None:
        log.warning(
            "%s: %s (attempt %d/%d, retrying in %.0fs)",
            what,
            state.outcome.exception() if state.outcome else "?",
            state.attempt_number,
            attempts,
            state.upcoming_sleep,
        )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientError),
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=base_delay, max=max_delay),
        sleep=sleep,
        before_sleep=warn,
        reraise=True,
    )
    try:
        return retrying(fn)
    except TransientError as exc:
        raise PushFailed(f"{what}: gave up after {attempts} attempts: {exc}") from exc


def ensure_registry_tags(client: Any, image: ImageBuild, registry: str) -> None:
    """Give locally built images (built without --registry) their registry references."""
    local = image_ref(None, image.repo, image.tags[0])
    for tag, ref in zip(image.tags, image.refs, strict=True):
        try:
            client.images.get(ref)
            continue
        except Exception:
            pass
        try:
            client.images.get(local).tag(f"{registry}/{image.repo}", tag=tag)
        except Exception:
            raise UserError(
                f"{ref} is not a local image: run `make image` (same version and commit) first"
            ) from None


def push_plan(
    plan: Plan,
    client: Any,
    creds: RegistryCredentials | None,
    *,
    attempts: int = 5,
    sleep: Callable[[float], None] = time.sleep,
    on_event: Callable[[str, dict[str, Any]], None] = lambda ref, event: None,
) -> list[tuple[str, str]]:
    """Push every tag of every image in plan order; return (reference, digest) pairs."""
    if not plan.registry:
        raise UserError("push needs a registry: pass --registry or set RAYLIFT_REGISTRY")
    pushed = []
    auth = creds.auth_config() if creds else None
    for image in plan.images:
        ensure_registry_tags(client, image, plan.registry)
        for index, (tag, ref) in enumerate(zip(image.tags, image.refs, strict=True)):
            repository = f"{plan.registry}/{image.repo}"
            try:
                digest = with_retries(
                    lambda repository=repository, tag=tag, ref=ref: push_once(
                        client.api, repository, tag, auth, lambda ev, ref=ref: on_event(ref, ev)
                    ),
                    what=f"push {ref}",
                    attempts=attempts,
                    sleep=sleep,
                )
            except PushFailed as exc:
                # infra/ makes repositories tag-immutable by default: the exact tag is what
                # nodes run, so a moving tag that cannot move is worth a warning, not a failure.
                if index > 0 and IMMUTABLE_TAG.search(str(exc)):
                    log.warning("%s not updated: the repository's tags are immutable", ref)
                    continue
                if IMMUTABLE_TAG.search(str(exc)):
                    raise PushFailed(
                        f"{ref} is already in the registry and its tags are immutable: commit "
                        "or pass a new --version to push a new image"
                    ) from exc
                raise
            pushed.append((ref, digest))
    return pushed


def resolve_registry(
    cli_value: str | None,
    env: Mapping[str, str] = os.environ,
    pulumi: Callable[[], str | None] | None = None,
) -> str | None:
    """--registry, then $RAYLIFT_REGISTRY, then the host of infra/'s ECR repositories."""
    if cli_value:
        return normalize_registry(cli_value)
    if env.get(REGISTRY_ENV):
        return normalize_registry(env[REGISTRY_ENV])
    value = (pulumi or pulumi_stack_registry)()
    return normalize_registry(value) if value else None


def pulumi_stack_registry(root: Path = REPO_ROOT) -> str | None:
    """Registry host of the selected stack in infra/, from its `repositories` output.

    infra/ exports the ECR repository URLs (`{"base": "<host>/raylift/base", ...}`); every
    one starts with the same registry host, which is all a push needs.
    """
    if not shutil.which("pulumi") or not (root / "infra" / "Pulumi.yaml").is_file():
        return None
    try:
        result = subprocess.run(
            ["pulumi", "stack", "output", PULUMI_REPOSITORIES_OUTPUT, "--json", "--cwd",
             str(root / "infra")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return registry_from_repositories(result.stdout)


def registry_from_repositories(output: str) -> str | None:
    """The host part of the repository URLs in a `pulumi stack output --json` answer."""
    try:
        urls = json.loads(output or "null")
    except json.JSONDecodeError:
        return None
    if not isinstance(urls, dict) or not urls:
        return None
    hosts = {normalize_registry(str(url)).split("/", 1)[0] for url in urls.values()}
    return hosts.pop() if len(hosts) == 1 else None


def write_tag_file(plan: Plan, path: Path) -> str | None:
    """Record the trainer-gpu tag a push just pushed, for the stack to read; None (and the file
    untouched) when this push did not include that image."""
    image = next((i for i in plan.images if i.name == TAG_FILE_IMAGE), None)
    if image is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(image.tags[0] + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: the stack never reads half a tag
    return image.tags[0]


def run_push(
    plan: Plan,
    client: Any,
    *,
    region: str | None,
    ecr_factory: Callable[[str], Any] = make_ecr_client,
    attempts: int = 5,
) -> list[tuple[str, str]]:
    """Log in to ECR (or use the engine's stored login elsewhere), push, report digests."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    assert plan.registry is not None
    creds = None
    match = ECR_RE.match(plan.registry)
    if match:
        creds = ecr_credentials(ecr_factory(region or match["region"]), plan.registry)
        registry_login(client, creds)
        log.info("logged in to %s as %s", creds.registry, creds.username)
    else:
        log.info("%s is not ECR: using the engine's stored credentials", plan.registry)
    layers: dict[str, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=stderr_console()
    ) as progress:
        tasks: dict[str, Any] = {}

        def on_event(ref: str, event: dict[str, Any]) -> None:
            if ref not in tasks:
                tasks[ref] = progress.add_task(f"push {ref}", total=None)
            detail = event.get("progressDetail") or {}
            if event.get("id") and detail.get("total"):
                layers[ref][event["id"]] = (detail.get("current", 0), detail["total"])
                done = sum(c for c, _ in layers[ref].values())
                total = sum(t for _, t in layers[ref].values())
                progress.update(tasks[ref], completed=done, total=total)

        pushed = push_plan(plan, client, creds, attempts=attempts, on_event=on_event)
    return pushed


def verify_pushed(engine: Any, ref: str, digest: str) -> str:
    """Pull `ref` back by digest and check it is the image that was pushed (same image id).

    A registry that rewrote or lost a layer, or a tag that moved under us, fails here, not on
    a node an hour later. Returns the digest reference nodes can pin.
    """
    repo = ref.rsplit(":", 1)[0]
    pinned = f"{repo}@{digest}"
    pulled = engine.pull(pinned)
    local = engine.image_id(ref)
    if pulled != local:
        raise PushFailed(f"{pinned} pulls back as {pulled[:19]}, not the pushed {local[:19]}")
    return pinned


def run_push_engine(
    plan: Plan,
    engine: Any,
    *,
    region: str | None,
    ecr_factory: Callable[[str], Any] = make_ecr_client,
    attempts: int = 5,
    sleep: Callable[[float], None] = time.sleep,
) -> list[tuple[str, str]]:
    """Push with a daemonless engine (buildah): log in to ECR only when the registry is ECR,
    push every tag in plan order with retries, and pull each exact tag back by digest."""
    assert plan.registry is not None
    auth = None
    match = ECR_RE.match(plan.registry)
    if match:
        creds = ecr_credentials(ecr_factory(region or match["region"]), plan.registry)
        auth = (creds.username, creds.password)
        log.info("logged in to %s as %s", creds.registry, creds.username)
    pushed = []
    for image in plan.images:
        local = image_ref(None, image.repo, image.tags[0])
        for index, ref in enumerate(image.refs):
            if not engine.exists(ref):
                if not engine.exists(local):
                    raise UserError(
                        f"{ref} is not a local image: run `make image` (same version and "
                        "commit) first"
                    )
                engine.tag(local, ref)

            def once(ref: str = ref) -> str:
                try:
                    return engine.push(ref, auth)
                except PushFailed as exc:
                    if is_transient(str(exc)):
                        raise TransientError(str(exc)) from exc
                    raise

            try:
                digest = with_retries(once, what=f"push {ref}", attempts=attempts, sleep=sleep)
            except PushFailed as exc:
                if index > 0 and IMMUTABLE_TAG.search(str(exc)):
                    log.warning("%s not updated: the repository's tags are immutable", ref)
                    continue
                raise
            if index == 0:
                log.info("pulled back %s: same image", verify_pushed(engine, ref, digest))
            pushed.append((ref, digest))
    return pushed
