#!/usr/bin/env python
"""Build, push and lock Raylift's training images, as described by images/graph.yaml.

    python tools/image.py build [--dry-run] [--only LAYER] [--variant gpu|cpu] [--registry R]
                                [--build-arg [NAME:]K=V ...] [--version V]
    python tools/image.py plan  (same options as build; prints the plan, needs no engine)
    python tools/image.py push  [--registry R] [--region R] [--dry-run] [--only ...]
    python tools/image.py lock  [--only NAME] [--check]

This is the only code that reads the graph file (DESIGN.md). The parts are kept apart on
purpose so each can be tested without a Docker engine or AWS: the graph and the plan are
pure data; building shells out to `docker build`; pushing goes through any object shaped
like the Docker SDK's client; the ECR token exchange is plain boto3 and its decoding a pure
function; lock resolution is pip's own resolver run with --dry-run --report.

Why `docker build` and not the SDK for the build step: the Docker SDK's build endpoint drives
the legacy builder, which rejects `RUN --mount` (pip cache mounts, bind mounts from other
stages); BuildKit is only reachable through the CLI (docker/docker-py#2230). Everything else
(engine check, image lookup, tagging, login, push) uses the SDK.
"""

from __future__ import annotations

import argparse
import base64
import collections
import email.parser
import fnmatch
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GRAPH = REPO_ROOT / "images" / "graph.yaml"
REGISTRY_ENV = "RAYLIFT_REGISTRY"
PULUMI_REPOSITORIES_OUTPUT = "repositories"
# `push` writes the exact tag of the GPU trainer image it pushed here; infra/ reads it
# (raylift:image.tagFile, default ../build/image-tag) and derives the CPU tag from it.
TAG_FILE = REPO_ROOT / "build" / "image-tag"
TAG_FILE_IMAGE = "trainer-gpu"

log = logging.getLogger("raylift.image")
T = TypeVar("T")


# --------------------------------------------------------------------------- errors


class UserError(Exception):
    """A problem the user can fix; shown as one line (no traceback unless --debug)."""


class EngineUnavailable(UserError):
    """No Docker engine answers; building or pushing cannot start."""


class BuildFailed(UserError):
    """`docker build` exited non-zero; carries the failing step and the log tail."""

    def __init__(self, message: str, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tail = list(tail)


class PushFailed(UserError):
    """A push failed for good (permanent error, or transient errors past the retry budget)."""


class TransientError(Exception):
    """A failure worth retrying: the registry or the network hiccupped, not the request."""


# --------------------------------------------------------------------------- the graph

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
REPO_RE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
ARG_RE = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
# Build args the tool sets on every image; each Dockerfile may declare the ones it uses.
AUTO_ARGS = ("BASE_IMAGE", "LOCK_FILE", "VERSION", "VCS_REF", "SOURCE_URL")


class SdistCheck(BaseModel):
    """How to learn an sdist's runtime requirements without building it.

    PKG-INFO is enough when it is Metadata >= 2.2 and does not list Requires-Dist as Dynamic
    (PEP 643). When setup.py computes them, name the file inside the sdist it reads them
    from (`requires_from`) and anything it adds conditionally (`plus`).
    """

    model_config = ConfigDict(extra="forbid")

    requires_from: str | None = None
    plus: list[str] = Field(default_factory=list)


class LockCheck(BaseModel):
    """What PyPI cannot answer by metadata for one image, so the lock check must be told."""

    model_config = ConfigDict(extra="forbid")

    substitute: dict[str, str] = Field(default_factory=dict)
    ignore_extra: list[str] = Field(default_factory=list)
    not_on_pypi: dict[str, str] = Field(default_factory=dict)
    sdist: dict[str, SdistCheck] = Field(default_factory=dict)


class ImageSpec(BaseModel):
    """One image of the graph, as written in images/graph.yaml."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    layer: str
    variant: Literal["gpu", "cpu"]
    repo: str = Field(pattern=REPO_RE.pattern)
    dockerfile: str
    requirements: str
    lock: str
    base: str | None = None
    args: dict[str, str] = Field(default_factory=dict)
    lock_check: LockCheck = Field(default_factory=LockCheck)


class Graph(BaseModel):
    """The whole graph file. `images` keeps file order, which breaks ties in build order."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, populate_by_name=True)

    schema_version: int = Field(alias="schema")
    python: str
    glibc: str = Field(pattern=r"^2\.\d+$")
    context: str = "."
    images: dict[str, ImageSpec]


def _pydantic_one_line(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {where}: {first['msg']}{more}"


def load_graph(path: Path = DEFAULT_GRAPH, root: Path = REPO_ROOT) -> Graph:
    """Read and validate the graph; every problem becomes one line naming the file and key."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: graph file not found") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with `images:` at the top")
    try:
        graph = Graph.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_pydantic_one_line(path, exc)) from None
    validate_graph(graph, path, root)
    return graph


def dockerfile_args(dockerfile: Path) -> set[str]:
    """ARG names a Dockerfile declares (anywhere: global or in a stage)."""
    return set(ARG_RE.findall(dockerfile.read_text()))


def validate_graph(graph: Graph, path: Path, root: Path) -> None:
    """Checks pydantic cannot: references, cycles, files on disk, args the Dockerfile reads.

    A graph arg that no ARG declares would be silently ignored by BuildKit, so a typo in the
    graph would build the wrong thing without a word; that is why it is an error here.
    """
    if not graph.images:
        raise UserError(f"{path}: images: is empty")
    for name, spec in graph.images.items():
        where = f"{path}: images.{name}"
        if not NAME_RE.match(name):
            raise UserError(f"{where}: name must match {NAME_RE.pattern} (it starts image tags)")
        if spec.base is not None:
            if spec.base not in graph.images:
                known = ", ".join(graph.images)
                raise UserError(f"{where}.base: {spec.base!r} is not an image here ({known})")
            if graph.images[spec.base].variant != spec.variant:
                raise UserError(
                    f"{where}.base: {spec.base!r} is a {graph.images[spec.base].variant} image "
                    f"but {name!r} is {spec.variant}"
                )
        for key in ("dockerfile", "requirements", "lock"):
            rel = getattr(spec, key)
            if not (root / rel).is_file():
                raise UserError(f"{where}.{key}: {rel} does not exist")
        declared = dockerfile_args(root / spec.dockerfile)
        for arg in spec.args:
            if arg not in declared:
                raise UserError(
                    f"{where}.args.{arg}: {spec.dockerfile} declares no ARG {arg}, "
                    "so the value would be ignored"
                )
    build_order(graph, path)


def build_order(graph: Graph, path: Path | str = "graph") -> list[str]:
    """Parents before children; among images ready at the same time, file order."""
    pending = list(graph.images)
    done: list[str] = []
    while pending:
        ready = [n for n in pending if graph.images[n].base is None or graph.images[n].base in done]
        if not ready:
            cycle = " -> ".join(f"{n}(base {graph.images[n].base})" for n in pending)
            raise UserError(f"{path}: images form a cycle: {cycle}")
        done.append(ready[0])
        pending.remove(ready[0])
    return done


def chain(graph: Graph, name: str) -> list[str]:
    """The image and its ancestors, root first: what is installed in that image."""
    names = [name]
    while (base := graph.images[names[0]].base) is not None:
        names.insert(0, base)
    return names


# --------------------------------------------------------------------------- the plan

TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class GitInfo:
    """The commit images are built from: it goes into tags and the revision label."""

    sha: str
    dirty: bool = False
    source_url: str = "unknown"

    @property
    def short(self) -> str:
        return self.sha[:7]


@dataclass(frozen=True)
class ImageBuild:
    """One image of a plan: everything `docker build` needs, nothing it has to look up."""

    name: str
    layer: str
    variant: str
    repo: str
    dockerfile: str
    context: str
    tags: tuple[str, ...]  # exact tag first, then the moving tag
    refs: tuple[str, ...]  # [registry/]repo:tag for each tag
    build_args: dict[str, str]
    base: str | None

    @property
    def ref(self) -> str:
        """The exact, commit-pinned reference."""
        return self.refs[0]


@dataclass(frozen=True)
class Plan:
    """What a build or a push would do, in order; printable without an engine."""

    images: tuple[ImageBuild, ...]
    version: str
    git: GitInfo
    registry: str | None


def git_info(root: Path = REPO_ROOT) -> GitInfo:
    """Commit, dirtiness and origin URL of the checkout; a clear error outside git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        raise UserError(
            f"{root} is not a git checkout with a commit: pass --git-sha to name the commit"
        ) from None
    try:
        source = git("remote", "get-url", "origin") or "unknown"
    except subprocess.CalledProcessError:
        source = "unknown"
    return GitInfo(sha=sha, dirty=dirty, source_url=_strip_credentials(source))


def _strip_credentials(url: str) -> str:
    """Never let a token embedded in a remote URL reach an image label."""
    return re.sub(r"//[^/@]+@", "//", url)


def project_version(root: Path = REPO_ROOT) -> str:
    """Default image version: the package version in pyproject.toml."""
    with (root / "pyproject.toml").open("rb") as fh:
        return str(tomllib.load(fh)["project"]["version"])


def image_ref(registry: str | None, repo: str, tag: str) -> str:
    return f"{registry}/{repo}:{tag}" if registry else f"{repo}:{tag}"


def parse_build_args(values: Sequence[str], graph: Graph) -> dict[str | None, dict[str, str]]:
    """`K=V` applies to every image; `NAME:K=V` to one image, or to every image of a layer."""
    scoped: dict[str | None, dict[str, str]] = collections.defaultdict(dict)
    layers = {spec.layer for spec in graph.images.values()}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise UserError(f"--build-arg {value!r}: expected K=V or NAME:K=V")
        scope: str | None = None
        if ":" in key:
            scope, key = key.split(":", 1)
            if scope not in graph.images and scope not in layers:
                raise UserError(f"--build-arg {value!r}: {scope!r} is no image or layer name")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise UserError(f"--build-arg {value!r}: {key!r} is not a valid ARG name")
        scoped[scope][key] = val
    return scoped


def select(graph: Graph, only: str | None, variant: str | None) -> list[str]:
    """Images the user asked for, in build order. `only` is a layer or an image name."""
    names = build_order(graph)
    if only is not None:
        names = [n for n in names if n == only or graph.images[n].layer == only]
    if variant is not None:
        names = [n for n in names if graph.images[n].variant == variant]
    if not names:
        layers = sorted({s.layer for s in graph.images.values()})
        raise UserError(
            f"no image matches --only {only} --variant {variant}: layers are "
            f"{', '.join(layers)}; images are {', '.join(graph.images)}"
        )
    return names


def make_plan(
    graph: Graph,
    *,
    version: str,
    git: GitInfo,
    registry: str | None = None,
    only: str | None = None,
    variant: str | None = None,
    build_args: Sequence[str] = (),
) -> Plan:
    """Order, tags and build args for the selected images; a pure function of its inputs.

    A child's BASE_IMAGE is its parent's exact tag from the same plan, so a trainer image can
    never sit on a base from another commit by accident (`--build-arg BASE_IMAGE=...` still
    overrides, on purpose).
    """
    registry = normalize_registry(registry) if registry else None
    suffix = f"{git.short}-dirty" if git.dirty else git.short
    overrides = parse_build_args(build_args, graph)
    all_refs: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for name, spec in graph.images.items():
        tags = (f"{name}-{version}-{suffix}", f"{name}-latest")
        for tag in tags:
            if not TAG_RE.match(tag):
                raise UserError(f"tag {tag!r} is not a valid Docker tag: check --version {version}")
        all_refs[name] = (tags, tuple(image_ref(registry, spec.repo, t) for t in tags))
    images = []
    for name in select(graph, only, variant):
        spec = graph.images[name]
        args = dict(spec.args)
        if spec.base is not None:
            args["BASE_IMAGE"] = all_refs[spec.base][1][0]
        args["LOCK_FILE"] = spec.lock
        args["VERSION"] = version
        args["VCS_REF"] = git.sha
        args["SOURCE_URL"] = git.source_url
        for scope in (None, spec.layer, name):
            args.update(overrides.get(scope, {}))
        tags, refs = all_refs[name]
        images.append(
            ImageBuild(
                name=name,
                layer=spec.layer,
                variant=spec.variant,
                repo=spec.repo,
                dockerfile=spec.dockerfile,
                context=graph.context,
                tags=tags,
                refs=refs,
                build_args=dict(sorted(args.items())),
                base=spec.base,
            )
        )
    return Plan(images=tuple(images), version=version, git=git, registry=registry)


def format_plan(plan: Plan) -> str:
    """The plan as text: one block per image, in build order."""
    lines = [
        f"plan: {len(plan.images)} image(s), version {plan.version}, commit {plan.git.short}"
        + (" (dirty)" if plan.git.dirty else "")
        + f", registry {plan.registry or '(local only)'}"
    ]
    for i, image in enumerate(plan.images, 1):
        lines.append(f"{i}. {image.name}  ({image.dockerfile})")
        lines.append(f"   tags: {', '.join(image.refs)}")
        if image.base:
            lines.append(f"   from: {image.build_args.get('BASE_IMAGE')}")
        lines.append(
            "   args: "
            + " ".join(f"{k}={v}" for k, v in image.build_args.items() if k != "BASE_IMAGE")
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- building


def docker_client(timeout: int = 10) -> Any:
    """A Docker SDK client that has answered a ping, or EngineUnavailable in one line."""
    import docker

    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # the SDK raises DockerException, requests' errors, OSError...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EngineUnavailable(
            f"no Docker engine answers at {host} ({reason[:120]}): start Docker or set "
            "DOCKER_HOST; `--dry-run` prints the plan without one"
        ) from exc
    return client


def ensure_buildx(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> None:
    """The Dockerfiles need BuildKit (cache and bind mounts), which the CLI reaches via buildx.

    Without the plugin `docker build` stops at once with a multi-line message; say it in one
    line, before any image is attempted.
    """
    try:
        result = run(["docker", "buildx", "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"cannot run `docker buildx version`: {exc}") from None
    if result.returncode != 0:
        raise EngineUnavailable(
            "this docker CLI has no buildx plugin, and the images need BuildKit: install "
            "docker-buildx-plugin (or Docker Desktop) and retry"
        )


def build_command(image: ImageBuild, root: Path) -> list[str]:
    """The `docker build` command line for one image (BuildKit, plain progress for parsing)."""
    cmd = ["docker", "build", "--progress=plain", "--file", str(root / image.dockerfile)]
    for ref in image.refs:
        cmd += ["--tag", ref]
    for key, value in image.build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    cmd.append(str((root / image.context).resolve()))
    return cmd


class LineRunner(Protocol):
    def __call__(self, cmd: Sequence[str], env: Mapping[str, str]) -> Iterator[str | int]: ...


def subprocess_lines(cmd: Sequence[str], env: Mapping[str, str]) -> Iterator[str | int]:
    """Yield a command's merged output line by line, then its exit code."""
    with subprocess.Popen(
        list(cmd),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        yield from (line.rstrip("\n") for line in proc.stdout)
        yield proc.wait()


STEP_RE = re.compile(r"^#(?P<id>\d+) \[(?P<step>[^\]]+)\] (?P<what>.*)$")
STEP_ERROR_RE = re.compile(r"^#(?P<id>\d+) ERROR: ")
SOLVE_ERROR_PREFIX = "ERROR: failed to solve: "


def build_image(
    image: ImageBuild,
    root: Path,
    *,
    runner: LineRunner = subprocess_lines,
    on_step: Callable[[str], None] = lambda step: None,
    tail_lines: int = 30,
) -> None:
    """Run one build, reporting each BuildKit step; on failure raise with the failing step.

    BuildKit runs independent stages in parallel and interleaves their output, so the failing
    step is the one whose id the `#N ERROR:` line names, not the last header printed. The
    whole log streams at debug level; the last lines are kept so a failure shows the step's
    own output, not just "exit code 1".
    """
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    headers: dict[str, str] = {}
    step = "(before the first step)"
    failed_step: str | None = None
    reason = ""
    code: int | None = None
    for item in runner(build_command(image, root), env):
        if isinstance(item, int):
            code = item
            break
        tail.append(item)
        log.debug("%s | %s", image.name, item)
        if match := STEP_RE.match(item):
            step = headers[match["id"]] = f"[{match['step']}] {match['what']}"
            on_step(step)
        elif (match := STEP_ERROR_RE.match(item)) and failed_step is None:
            failed_step = headers.get(match["id"])
        elif item.startswith(SOLVE_ERROR_PREFIX):
            reason = item[len(SOLVE_ERROR_PREFIX) :]
    if code != 0:
        where = (failed_step or step)[:120]
        why = f": {reason[:160]}" if reason else ""
        raise BuildFailed(
            f"build of {image.name} failed (exit {code}) at {where}{why} (log tail above)", tail
        )


def run_build(
    plan: Plan,
    root: Path,
    client: Any,
    *,
    runner: LineRunner = subprocess_lines,
) -> None:
    """Build the plan in order with progress; parents outside the plan must exist locally."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    planned = {image.ref for image in plan.images}
    for image in plan.images:
        parent = image.build_args.get("BASE_IMAGE")
        if image.base and parent not in planned:
            try:
                client.images.get(parent)
            except Exception:
                raise UserError(
                    f"{image.name} builds FROM {parent}, which is not a local image: build "
                    f"{image.base} first (drop --only) or pass --build-arg BASE_IMAGE=..."
                ) from None
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=_stderr_console(),
    ) as progress:
        overall = progress.add_task("images", total=len(plan.images))
        for image in plan.images:
            task = progress.add_task(f"{image.name}: starting", total=None)

            def on_step(step: str, task: Any = task, name: str = image.name) -> None:
                progress.update(task, description=f"{name}: {step[:70]}")

            try:
                build_image(image, root, runner=runner, on_step=on_step)
            except BuildFailed as exc:
                progress.stop()
                for line in exc.tail:
                    log.error("%s | %s", image.name, line)
                raise
            progress.update(task, description=f"{image.name}: built {image.ref}", total=1)
            progress.update(task, completed=1)
            progress.advance(overall)
    for image in plan.images:
        log.info("built %s", ", ".join(image.refs))


# --------------------------------------------------------------------------- ECR + push

ECR_RE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$"
)


def normalize_registry(registry: str) -> str:
    """Registry host as Docker wants it in a reference: no scheme, no trailing slash."""
    return re.sub(r"^https?://", "", registry.strip()).rstrip("/")


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
    """Call fn, retrying TransientError with exponential backoff; other errors pass through."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TransientError as exc:
            if attempt == attempts:
                raise PushFailed(f"{what}: gave up after {attempts} attempts: {exc}") from exc
            delay = min(max_delay, base_delay * 2 ** (attempt - 1))
            log.warning(
                "%s: %s (attempt %d/%d, retrying in %.0fs)", what, exc, attempt, attempts, delay
            )
            sleep(delay)
    raise AssertionError("unreachable")


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
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=_stderr_console()
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


# --------------------------------------------------------------------------- locks

LOCK_LINE_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]+)\])?==(?P<version>\S+)$"
)


def canonical(name: str) -> str:
    """PEP 503 name normalisation (what pip's report and indexes use)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """One `name[extras]==version` line of a lock file."""

    name: str
    version: str
    extras: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return canonical(self.name)

    def __str__(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}=={self.version}"


def read_pins(path: Path) -> list[Pin]:
    """Parse a lock or requirements input. Everything must be an exact `==` pin."""
    pins = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = LOCK_LINE_RE.match(line)
        if not match:
            raise UserError(f"{path}:{lineno}: {line!r} is not an exact pin (name==version)")
        extras = tuple(sorted(e.strip() for e in (match["extras"] or "").split(",") if e.strip()))
        pins.append(Pin(match["name"], match["version"], extras))
    return pins


def pip_platform_args(python: str, glibc: str) -> list[str]:
    """Target the image, not this machine: CPython `python` on x86_64 Linux with `glibc`.

    pip only accepts the exact platform tags it is given, so every manylinux tag the image's
    glibc can load is listed (plus the legacy aliases and plain linux_x86_64).
    """
    minor = int(glibc.split(".")[1])
    tags = [f"manylinux_2_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    abi = "cp" + python.replace(".", "")
    args = ["--python-version", python, "--implementation", "cp"]
    for tag in tags:
        args += ["--platform", tag]
    for a in (abi, "abi3", "none"):
        args += ["--abi", a]
    return args


def pip_env() -> dict[str, str]:
    """The environment pip resolves in: this machine's pip config and wheel caches left out.

    The question is "does the index serve these pins for the image's platform", so local
    find-links, extra indexes and constraint files (set by a developer or CI image) must not
    answer it. The index URL and certificates stay, for mirrors.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for keep in ("PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@dataclass
class Resolution:
    """pip's answer: every distribution it would install, with the version it chose."""

    pins: dict[str, Pin]
    seconds: float


class PipRunner(Protocol):
    def __call__(
        self, cmd: Sequence[str], env: Mapping[str, str]
    ) -> subprocess.CompletedProcess[str]: ...


SELF_PIP = (sys.executable, "-m", "pip")


def run_pip(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=dict(env), capture_output=True, text=True, timeout=900)


def resolve(
    requirements: Sequence[str],
    *,
    python: str,
    glibc: str,
    constraints: Sequence[str] = (),
    runner: PipRunner = run_pip,
    pip: Sequence[str] = SELF_PIP,
) -> Resolution:
    """Resolve with pip --dry-run --report, wheels only, reading metadata, not whole wheels.

    pip >= 22.3 reads PEP 658 metadata files when the index serves them; where it does not
    (some mirrors), --use-feature=fast-deps reads just the metadata of each wheel through
    HTTP range requests. Without either, pip would download every wheel (several GB for the
    CUDA torch stack).
    """
    with tempfile.TemporaryDirectory(prefix="raylift-lock-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(requirements) + "\n")
        constraint_args: list[str] = []
        if constraints:
            constraint_file = Path(tmp) / "constraints.txt"
            constraint_file.write_text("\n".join(constraints) + "\n")
            constraint_args = ["-c", str(constraint_file)]
        report = Path(tmp) / "report.json"
        cmd = [
            *pip,
            "install",
            "--dry-run",
            "--quiet",
            "--ignore-installed",
            "--only-binary=:all:",
            "--use-feature=fast-deps",
            "--target",
            str(Path(tmp) / "target"),
            "--report",
            str(report),
            *pip_platform_args(python, glibc),
            *constraint_args,
            "-r",
            str(req),
        ]
        started = time.monotonic()
        result = runner(cmd, pip_env())
        seconds = time.monotonic() - started
        if result.returncode != 0:
            lines = [
                ln
                for ln in (result.stderr or "").splitlines()
                if ln.startswith("ERROR") and "fast-deps" not in ln
            ]
            detail = " | ".join(lines[-3:]) or (result.stderr or "")[-300:]
            target = f"cp{python.replace('.', '')}/glibc {glibc}"
            raise UserError(f"pip cannot resolve these pins for {target}: {detail}")
        data = json.loads(report.read_text())
    pins = {}
    for item in data.get("install", []):
        meta = item["metadata"]
        extras = tuple(sorted(item.get("requested_extras") or ()))
        pin = Pin(meta["name"], meta["version"], extras)
        pins[pin.key] = pin
    return Resolution(pins=pins, seconds=seconds)


@cache
def sdist_metadata(
    name: str, version: str, member: str | None = None, pip: tuple[str, ...] = SELF_PIP
) -> tuple[str, str]:
    """(PKG-INFO, text of `member`) of an sdist, fetched by pip without building it."""
    with tempfile.TemporaryDirectory(prefix="raylift-sdist-") as tmp:
        result = subprocess.run(
            [*pip, "download", "--quiet", "--no-deps", "--no-binary=:all:", "--dest", tmp,
             f"{name}=={version}"],
            env=pip_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if result.returncode != 0:
            raise UserError(f"cannot fetch the sdist of {name}=={version}: {result.stderr[-300:]}")
        archive = next(Path(tmp).glob("*.tar.gz"), None)
        if archive is None:
            raise UserError(f"{name}=={version}: the index has no .tar.gz sdist")
        with tarfile.open(archive) as tar:
            top = tar.getnames()[0].split("/")[0]

            def read(rel: str) -> str:
                try:
                    fh = tar.extractfile(f"{top}/{rel}")
                except KeyError:
                    fh = None
                if fh is None:
                    raise UserError(f"{archive.name} has no {rel}")
                return fh.read().decode("utf-8")

            return read("PKG-INFO"), read(member) if member else ""


def sdist_requires(name: str, version: str, check: SdistCheck) -> tuple[str, ...]:
    """Runtime requirements of an sdist, read from its files instead of from a build."""
    pkg_info, member = sdist_metadata(name, version, check.requires_from)
    meta = email.parser.Parser().parsestr(pkg_info)
    if check.requires_from:
        lines = (ln.split("#", 1)[0].strip() for ln in member.splitlines())
        found = [ln for ln in lines if ln and not ln.startswith("-")]
    else:
        version_str = meta.get("Metadata-Version", "1.0")
        major, minor = (int(p) for p in version_str.split(".")[:2])
        dynamic = {d.lower() for d in meta.get_all("Dynamic") or []}
        if (major, minor) < (2, 2) or "requires-dist" in dynamic:
            raise UserError(
                f"{name}=={version}: its PKG-INFO ({version_str}) leaves Requires-Dist to the "
                "build; name the file setup.py reads them from (lock_check.sdist.requires_from)"
            )
        found = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return (*found, *check.plus)


@dataclass
class LockReport:
    """Outcome of checking one image's chain of locks against the index."""

    image: str
    resolution: Resolution
    unpinned: list[Pin]  # resolved, but in no lock of the chain: the lock is incomplete
    notes: list[str]  # what could not be checked against PyPI, and why


def merged_lock_check(graph: Graph, names: Iterable[str]) -> LockCheck:
    """The lock_check entries of several images (a chain) as one."""
    merged = LockCheck()
    for node in names:
        check = graph.images[node].lock_check
        merged.substitute.update(check.substitute)
        merged.ignore_extra.extend(check.ignore_extra)
        merged.not_on_pypi.update(check.not_on_pypi)
        merged.sdist.update(check.sdist)
    return merged


def resolvable(pins: Iterable[Pin], check: LockCheck) -> tuple[list[str], list[str]]:
    """Turn pins into what pip can resolve against PyPI, with a note for each exception.

    Off-PyPI pins are left out, sdists are replaced by their static requirements, and
    substituted pins (a +cpu local version) by their PyPI stand-in.
    """
    not_on_pypi = {canonical(n): why for n, why in check.not_on_pypi.items()}
    sdists = {canonical(n): c for n, c in check.sdist.items()}
    requirements: list[str] = []
    notes: list[str] = []
    for pin in pins:
        text = str(pin)
        if pin.key in not_on_pypi:
            notes.append(f"not checked: {text} ({not_on_pypi[pin.key]})")
            continue
        if pin.key in sdists:
            requires = sdist_requires(pin.name, pin.version, sdists[pin.key])
            notes.append(
                f"sdist: {text} not built; its {len(requires)} runtime requirements, read "
                "from the sdist, are resolved instead"
            )
            requirements.extend(requires)
            continue
        bare = f"{pin.name}=={pin.version}"
        if bare in check.substitute:
            notes.append(f"substituted: {text} checked as {check.substitute[bare]}")
            text = check.substitute[bare]
        requirements.append(text)
    return requirements, notes


def chain_pins(graph: Graph, names: Iterable[str], root: Path) -> list[Pin]:
    """All pins of several images' locks; one package pinned twice must agree."""
    seen: dict[str, tuple[Pin, str]] = {}
    for node in names:
        lock = graph.images[node].lock
        for pin in read_pins(root / lock):
            if pin.key in seen and seen[pin.key][0].version != pin.version:
                other, where = seen[pin.key]
                raise UserError(f"{lock}: {pin} disagrees with {other} in {where}")
            seen.setdefault(pin.key, (pin, lock))
    return [pin for pin, _ in seen.values()]


def check_locks(
    graph: Graph, name: str, root: Path = REPO_ROOT, *, runner: PipRunner = run_pip
) -> LockReport:
    """Resolve an image's chain of locks for the image's platform; report incompleteness."""
    names = chain(graph, name)
    merged = merged_lock_check(graph, names)
    pins = chain_pins(graph, names, root)
    requirements, notes = resolvable(pins, merged)
    resolution = resolve(requirements, python=graph.python, glibc=graph.glibc, runner=runner)
    locked = {p.key for p in pins}
    unpinned = [
        pin
        for key, pin in sorted(resolution.pins.items())
        if key not in locked and not any(fnmatch.fnmatch(key, pat) for pat in merged.ignore_extra)
    ]
    return LockReport(image=name, resolution=resolution, unpinned=unpinned, notes=notes)


def write_locks(
    graph: Graph, root: Path, names: Iterable[str], *, runner: PipRunner = run_pip
) -> list[Path]:
    """Regenerate lock files from the requirements inputs, parents first.

    Versions are decided once per leaf image, from all the inputs along its chain: resolving
    base alone would pick the newest python-dateutil, which boto3 in trainer cannot take.
    Each image then resolves its own chain constrained to that answer, and its lock holds
    what it pulls in beyond its parents' locks. Images that share a lock file (trainer-gpu,
    trainer-cpu) get the union; a version the chains disagree on is an error.
    """
    wanted = set(names)
    order = build_order(graph)
    leaves = [n for n in order if not any(s.base == n for s in graph.images.values())]
    leaf_of = {}
    solutions: dict[str, list[str]] = {}
    for leaf in leaves:
        names_in_chain = chain(graph, leaf)
        if not wanted.intersection(names_in_chain):
            continue
        merged = merged_lock_check(graph, names_in_chain)
        inputs_by_node = [read_pins(root / graph.images[n].requirements) for n in names_in_chain]
        inputs, _ = resolvable([p for pins in inputs_by_node for p in pins], merged)
        log.info("resolving the %s chain (%s)", leaf, " -> ".join(names_in_chain))
        solution = resolve(inputs, python=graph.python, glibc=graph.glibc, runner=runner)
        solutions[leaf] = [f"{p.name}=={p.version}" for p in solution.pins.values()]
        for node in names_in_chain:
            leaf_of.setdefault(node, leaf)
    by_lock: dict[str, dict[str, Pin]] = {}
    header: dict[str, list[str]] = collections.defaultdict(list)
    written: list[Path] = []
    for name in order:
        if name not in wanted:
            continue
        spec = graph.images[name]
        names_in_chain = chain(graph, name)
        merged = merged_lock_check(graph, names_in_chain)
        parent_pins = chain_pins(graph, names_in_chain[:-1], root)
        own = read_pins(root / spec.requirements)
        inputs, _ = resolvable([*parent_pins, *own], merged)
        log.info("resolving %s (%d inputs)", name, len(inputs))
        resolution = resolve(
            inputs,
            python=graph.python,
            glibc=graph.glibc,
            constraints=solutions[leaf_of[name]],
            runner=runner,
        )
        parent_keys = {p.key for p in parent_pins}
        restore = {v: k for k, v in merged.substitute.items()}
        kept = {canonical(n) for n in (*merged.not_on_pypi, *merged.sdist)}
        lock = by_lock.setdefault(spec.lock, {})
        found = list(resolution.pins.values()) + [p for p in own if p.key in kept]
        for pin in found:
            if pin.key in parent_keys or any(
                fnmatch.fnmatch(pin.key, pat) for pat in merged.ignore_extra
            ):
                continue
            original = restore.get(f"{pin.name}=={pin.version}")
            if original:
                name_, _, version_ = original.partition("==")
                pin = Pin(name_, version_, pin.extras)
            if pin.key in lock and lock[pin.key].version != pin.version:
                raise UserError(
                    f"{spec.lock}: chains disagree on {pin.key}: {lock[pin.key]} vs {pin}"
                )
            lock[pin.key] = pin
        header[spec.lock].append(name)
        # Written at once: the next image's resolution reads this file as its parent's lock.
        path = root / spec.lock
        lines = [
            f"# Generated by `python tools/image.py lock` from {spec.requirements} for "
            f"{', '.join(header[spec.lock])}; do not edit by hand.",
            f"# Target: CPython {graph.python}, x86_64 Linux, glibc {graph.glibc}.",
        ]
        lines += [str(p) for p in sorted(lock.values(), key=lambda p: p.key)]
        path.write_text("\n".join(lines) + "\n")
        if path not in written:
            written.append(path)
    return written


# --------------------------------------------------------------------------- CLI


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", metavar="LAYER", help="one layer (base, bnb, ccl, trainer) or image")
    p.add_argument("--variant", choices=("gpu", "cpu"), help="only this variant's images")
    p.add_argument("--version", help="image version (default: pyproject.toml's)")
    p.add_argument("--git-sha", help="commit to tag with (default: HEAD of this checkout)")


def _global_options(top_level: bool) -> argparse.ArgumentParser:
    """--debug and --graph, accepted before or after the subcommand.

    Each parser gets its own copy: argparse shares action objects between a parser and its
    `parents`, so one set of defaults would let the subcommand's default overwrite a
    `--debug` given before it. Below the top level the default is "not given" (SUPPRESS).
    """
    common = argparse.ArgumentParser(add_help=False)
    debug_default = False if top_level else argparse.SUPPRESS
    graph_default = DEFAULT_GRAPH if top_level else argparse.SUPPRESS
    common.add_argument("--debug", action="store_true", default=debug_default,
                        help="verbose logs and tracebacks")  # fmt: skip
    common.add_argument("--graph", type=Path, default=graph_default, help="graph file")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/image.py", description=__doc__.split("\n")[0], parents=[_global_options(True)]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for command, help_text in (
        ("build", "build the images in dependency order"),
        ("plan", "print the build plan (order, tags, args); needs no engine"),
    ):
        p = sub.add_parser(command, parents=[_global_options(False)], help=help_text)
        _add_selection(p)
        p.add_argument("--registry", help="prefix tags with this registry host")
        p.add_argument("--build-arg", action="append", default=[], metavar="[NAME:]K=V",
                       help="override a build arg, for all images or one image/layer")  # fmt: skip
        if command == "build":
            p.add_argument("--dry-run", action="store_true", help="print the plan, build nothing")

    p = sub.add_parser(
        "push", parents=[_global_options(False)], help="push built images to the registry"
    )
    _add_selection(p)
    p.add_argument("--registry", help=f"registry host (default: ${REGISTRY_ENV}, then Pulumi)")
    p.add_argument("--region", help="AWS region of ECR (default: from the registry host)")
    p.add_argument("--dry-run", action="store_true", help="print what would be pushed")
    p.add_argument("--attempts", type=int, default=5, help="tries per tag on transient errors")
    p.add_argument("--allow-dirty", action="store_true", help="push a -dirty build anyway")
    p.add_argument("--tag-file", type=Path, default=TAG_FILE,
                   help="write the pushed trainer-gpu tag here, for infra/")  # fmt: skip

    p = sub.add_parser(
        "lock", parents=[_global_options(False)], help="regenerate or check the lock files"
    )
    p.add_argument("--only", metavar="IMAGE", help="one image (and the lock it writes)")
    p.add_argument("--check", action="store_true", help="check the locks resolve, write nothing")
    return parser


def _plan_from_args(args: argparse.Namespace, graph: Graph, registry: str | None) -> Plan:
    git = GitInfo(sha=args.git_sha) if args.git_sha else git_info()
    return make_plan(
        graph,
        version=args.version or project_version(),
        git=git,
        registry=registry,
        only=args.only,
        variant=args.variant,
        build_args=getattr(args, "build_arg", []),
    )


def _stderr_console() -> Any:
    """Logs and progress go to stderr, so stdout carries only results (plan, digests)."""
    from rich.console import Console

    return Console(stderr=True)


def _setup_logging(debug: bool) -> None:
    try:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=_stderr_console(), show_path=False, show_time=False
        )
        fmt = "%(message)s"
    except ImportError:  # the tools extra is missing; plain logs still work
        handler = logging.StreamHandler()
        fmt = "%(levelname)s %(message)s"
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format=fmt,
                        handlers=[handler], force=True)  # fmt: skip
    for noisy in ("urllib3", "botocore", "boto3", "docker"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph, REPO_ROOT)
    out = sys.stdout
    if args.command == "plan" or (args.command == "build" and args.dry_run):
        out.write(format_plan(_plan_from_args(args, graph, args.registry)) + "\n")
        return 0
    if args.command == "build":
        plan = _plan_from_args(args, graph, args.registry)
        if shutil.which("docker") is None:
            raise EngineUnavailable("the `docker` CLI is not on PATH: install Docker to build")
        client = docker_client()
        ensure_buildx()
        run_build(plan, REPO_ROOT, client)
        return 0
    if args.command == "push":
        registry = resolve_registry(args.registry)
        if not registry:
            raise UserError(
                f"no registry: pass --registry, set {REGISTRY_ENV}, or `pulumi up` in infra/ "
                f"so the stack has its `{PULUMI_REPOSITORIES_OUTPUT}` output"
            )
        plan = _plan_from_args(args, graph, registry)
        if args.dry_run:
            out.write(format_plan(plan) + "\n")
            return 0
        if plan.git.dirty and not args.allow_dirty:
            raise UserError(
                "the work tree has uncommitted changes: commit first, so the pushed tag names "
                "the commit the image was built from (or pass --allow-dirty)"
            )
        for ref, digest in run_push(plan, docker_client(), region=args.region,
                                    attempts=args.attempts):  # fmt: skip
            out.write(f"pushed {ref}@{digest}\n")
        tag = write_tag_file(plan, args.tag_file)
        if tag:
            out.write(f"wrote {tag} to {args.tag_file} (the stack's raylift:image.tagFile)\n")
        return 0
    if args.command == "lock":
        names = [args.only] if args.only else build_order(graph)
        unknown = [n for n in names if n not in graph.images]
        if unknown:
            raise UserError(f"--only {unknown[0]}: no such image ({', '.join(graph.images)})")
        if args.check:
            failed = False
            for name in names:
                report = check_locks(graph, name, REPO_ROOT)
                for note in report.notes:
                    log.info("%s: %s", name, note)
                if report.unpinned:
                    failed = True
                    log.error("%s: lock is missing %s", name, ", ".join(map(str, report.unpinned)))
                else:
                    log.info("%s: %d pins resolve (%.0fs)", name, len(report.resolution.pins),
                             report.resolution.seconds)  # fmt: skip
            return 1 if failed else 0
        for path in write_locks(graph, REPO_ROOT, names):
            out.write(f"wrote {path.relative_to(REPO_ROOT)}\n")
        return 0
    raise AssertionError(args.command)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.debug)
    try:
        return run(args)
    except UserError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
