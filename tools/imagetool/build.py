"""Building: one engine build per image of a plan, in order, with progress.

The engine (tools/imagetool/engine.py) is Docker BuildKit or buildah; both report their steps
line by line, which is all this module reads. Why the CLI and not the Docker SDK: the SDK's
build endpoint drives the legacy builder, which rejects `RUN --mount` (docker/docker-py#2230).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tools.imagetool.buildplan import ImageBuild, Plan
from tools.imagetool.console import stderr_console
from tools.imagetool.engine import BuildSettings, DockerEngine, Engine
from tools.imagetool.errors import BuildFailed, EngineUnavailable, UserError

log = logging.getLogger("raylift.image")


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


def build_command(
    image: ImageBuild, root: Path, settings: BuildSettings | None = None
) -> list[str]:
    """The `docker build` command line for one image (BuildKit, plain progress for parsing)."""
    return DockerEngine().build_command(image, root, settings or BuildSettings())


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
BUILDAH_STEP_RE = re.compile(r"^(?:\[\d+/\d+\] )?STEP (?P<step>\d+/\d+): (?P<what>.*)$")
BUILDAH_ERROR_RE = re.compile(r"^(?:Error|error building at STEP) ?(?P<what>.*)$")


def build_image(
    image: ImageBuild,
    root: Path,
    *,
    runner: LineRunner = subprocess_lines,
    on_step: Callable[[str], None] = lambda step: None,
    tail_lines: int = 30,
    engine: Engine | None = None,
    settings: BuildSettings | None = None,
) -> None:
    """Run one build, reporting each step; on failure raise with the failing step.

    BuildKit runs independent stages in parallel and interleaves their output, so the failing
    step is the one whose id the `#N ERROR:` line names, not the last header printed. buildah
    runs steps one by one (`STEP 3/12: RUN ...`), so there the last header is the failing one.
    The whole log streams at debug level; the last lines are kept so a failure shows the
    step's own output, not just "exit code 1".
    """
    engine = engine or DockerEngine()
    settings = settings or BuildSettings()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    headers: dict[str, str] = {}
    step = "(before the first step)"
    failed_step: str | None = None
    reason = ""
    code: int | None = None
    cmd = engine.build_command(image, root, settings)
    for item in runner(cmd, engine.build_env()):
        if isinstance(item, int):
            code = item
            break
        tail.append(item)
        log.debug("%s | %s", image.name, item)
        if match := STEP_RE.match(item):
            step = headers[match["id"]] = f"[{match['step']}] {match['what']}"
            on_step(step)
        elif match := BUILDAH_STEP_RE.match(item):
            step = f"[{match['step']}] {match['what']}"
            on_step(step)
        elif (match := STEP_ERROR_RE.match(item)) and failed_step is None:
            failed_step = headers.get(match["id"])
        elif item.startswith(SOLVE_ERROR_PREFIX):
            reason = item[len(SOLVE_ERROR_PREFIX) :]
        elif (match := BUILDAH_ERROR_RE.match(item)) and engine.name == "buildah":
            reason = match["what"].strip(": ")
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
    engine: Engine | None = None,
    settings: BuildSettings | None = None,
) -> dict[str, float]:
    """Build the plan in order with progress; parents outside the plan must exist locally.

    `client` answers `images.get(ref)` (the Docker SDK's client, or an EngineImages over any
    engine). Returns the seconds each image took.
    """
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
        console=stderr_console(),
    ) as progress:
        overall = progress.add_task("images", total=len(plan.images))
        seconds: dict[str, float] = {}
        for image in plan.images:
            task = progress.add_task(f"{image.name}: starting", total=None)

            def on_step(step: str, task: Any = task, name: str = image.name) -> None:
                progress.update(task, description=f"{name}: {step[:70]}")

            started = time.monotonic()
            try:
                build_image(
                    image, root, runner=runner, on_step=on_step, engine=engine, settings=settings
                )
            except BuildFailed as exc:
                progress.stop()
                for line in exc.tail:
                    log.error("%s | %s", image.name, line)
                raise
            seconds[image.name] = time.monotonic() - started
            progress.update(task, description=f"{image.name}: built {image.ref}", total=1)
            progress.update(task, completed=1)
            progress.advance(overall)
    for image in plan.images:
        log.info("built %s in %.0f s", ", ".join(image.refs), seconds[image.name])
    return seconds


class EngineImages:
    """The one SDK call run_build needs (`client.images.get`), answered by any engine."""

    def __init__(self, engine: Engine) -> None:
        self.images = self
        self.engine = engine

    def get(self, ref: str) -> str:
        if not self.engine.exists(ref):
            raise LookupError(ref)
        return ref
