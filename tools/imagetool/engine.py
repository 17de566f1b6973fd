"""Build engines: Docker BuildKit where an engine answers, buildah where none does.

Both build the same Dockerfiles with the same tags, build args and labels. The differences
stay here: how a build is started, how its steps are reported, how an image is looked up,
weighed and pushed. buildah runs without a daemon (`--isolation chroot`, the host network), so
a CI machine or a laptop without Docker still builds the real images; podman reads the same
storage for `inspect`.

Downloads inside a build need two things a machine behind a TLS-inspecting proxy has and an
image must never keep: the CA bundle and the proxy settings. The bundle goes in as the build
secret `ca` (mounted at /run/secrets/ca for the RUNs that download, never written to a layer);
proxies go in as the predefined proxy build args (Docker keeps them out of the image's history)
or, with buildah, through its `--http-proxy` pass-through of the caller's environment.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.imagetool.buildplan import ImageBuild
from tools.imagetool.errors import EngineUnavailable, PushFailed, UserError

ENGINE_ENV = "RAYLIFT_IMAGE_ENGINE"
CA_ENV = "RAYLIFT_CA_BUNDLE"
PROXY_ARGS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
# Where a machine's own CA bundle usually is; the first that exists is passed as the secret.
CA_CANDIDATES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, Amazon Linux
    "/etc/ssl/cert.pem",  # macOS, Alpine
)
# The folder of the build context that the Dockerfiles bind-mount as pip's --find-links.
WHEELHOUSE_DIR = Path("build") / "wheelhouse"
LOCAL_REGISTRY = re.compile(r"^(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$")


def run_text(cmd: Sequence[str], *, timeout: float = 120, input: str | None = None) -> str:
    """stdout of a short command; UserError naming it when it fails."""
    try:
        result = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, input=input
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"`{' '.join(cmd[:3])}` could not run: {exc}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`{' '.join(cmd[:3])}` failed (exit {result.returncode}): {last[:200]}")
    return result.stdout


def default_ca_bundle(env: Mapping[str, str] = os.environ) -> Path | None:
    """The bundle a build's downloads should trust: $RAYLIFT_CA_BUNDLE, then the bundle the
    caller's own tools use (SSL_CERT_FILE, REQUESTS_CA_BUNDLE), then the system's."""
    for key in (CA_ENV, "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"):
        if env.get(key):
            path = Path(env[key])
            if not path.is_file():
                raise UserError(f"${key}={path}: no such file; point it at a PEM CA bundle")
            return path
    return next((Path(p) for p in CA_CANDIDATES if Path(p).is_file()), None)


@dataclass(frozen=True)
class BuildSettings:
    """What a build may read from this machine without any of it landing in an image."""

    ca_bundle: Path | None = None
    proxies: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(
        cls, ca_bundle: Path | None = None, env: Mapping[str, str] = os.environ
    ) -> BuildSettings:
        if ca_bundle is not None and not ca_bundle.is_file():
            raise UserError(f"--ca-bundle {ca_bundle}: no such file; pass a PEM CA bundle")
        return cls(
            ca_bundle=ca_bundle or default_ca_bundle(env),
            proxies={k: env[k] for k in PROXY_ARGS if env.get(k)},
        )


@contextlib.contextmanager
def staged_wheelhouse(root: Path, wheelhouse: Path | None) -> Iterator[Path]:
    """stage_wheelhouse for the length of one build, holding a lock on the folder: a second
    build in the same checkout would swap the wheels under the first one's RUNs."""
    target = root / WHEELHOUSE_DIR
    target.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".wheelhouse.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"another build in this checkout is using {target}: wait for it to finish"
            ) from None
        yield stage_wheelhouse(root, wheelhouse)


def stage_wheelhouse(root: Path, wheelhouse: Path | None) -> Path:
    """Make build/wheelhouse/ in the context hold exactly `wheelhouse`'s wheels (or nothing).

    The Dockerfiles bind-mount that folder for pip's --find-links, so a wheel a machine cannot
    download (the +cpu torch where PyTorch's index is out of reach) is installed by pip inside
    the build, checked against the lock like any other, and never copied into a layer. Files
    are hard-linked where possible: a 200 MB torch wheel is not copied for every build.
    """
    wheels: list[Path] = []
    if wheelhouse is not None:
        if not wheelhouse.is_dir():
            raise UserError(f"--wheelhouse {wheelhouse}: not a folder; pass a folder of wheels")
        wheels = sorted(wheelhouse.glob("*.whl"))
        if not wheels:
            raise UserError(
                f"--wheelhouse {wheelhouse}: no .whl files there (fill it with `pip download "
                "--no-deps -d DIR PKG==VERSION`)"
            )
    target = root / WHEELHOUSE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():
        if old.is_file() or old.is_symlink():
            old.unlink()
    for wheel in wheels:
        try:
            os.link(wheel, target / wheel.name)
        except OSError:
            shutil.copy2(wheel, target / wheel.name)
    return target


class Engine:
    """One way to build, inspect and push images; see DockerEngine and BuildahEngine."""

    name = "engine"
    # Step header and failure lines of this engine's plain build output.

    def version(self) -> str:
        raise NotImplementedError

    def build_command(self, image: ImageBuild, root: Path, settings: BuildSettings) -> list[str]:
        raise NotImplementedError

    def build_env(self) -> dict[str, str]:
        return dict(os.environ)

    def exists(self, ref: str) -> bool:
        raise NotImplementedError

    def image_id(self, ref: str) -> str:
        raise NotImplementedError

    def size(self, ref: str) -> int:
        raise NotImplementedError

    def labels(self, ref: str) -> dict[str, str]:
        raise NotImplementedError

    def tag(self, ref: str, new_ref: str) -> None:
        raise NotImplementedError

    def push(self, ref: str, auth: tuple[str, str] | None = None) -> str:
        """Push `ref` (already tagged with its registry) and return the manifest digest."""
        raise NotImplementedError

    def pull(self, ref: str) -> str:
        """Pull `ref` (a digest reference, usually) and return the pulled image's id."""
        raise NotImplementedError

    def run_command(
        self,
        ref: str,
        argv: Sequence[str],
        *,
        user: str = "1000:1000",
        volumes: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> tuple[list[str], Callable[[], None]]:
        """The command line that runs `argv` in a new container of `ref` on the host network
        (no entrypoint: pass it in `argv`), and how to remove that container afterwards."""
        raise NotImplementedError

    def remove(self, ref: str) -> None:
        raise NotImplementedError


class DockerEngine(Engine):
    """Docker with BuildKit (through the CLI: the SDK's build endpoint is the legacy builder,
    which rejects `RUN --mount`, docker/docker-py#2230)."""

    name = "docker"

    def version(self) -> str:
        return run_text(["docker", "version", "--format", "{{.Server.Version}}"]).strip()

    def build_env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_BUILDKIT": "1"}

    def build_command(self, image: ImageBuild, root: Path, settings: BuildSettings) -> list[str]:
        cmd = ["docker", "build", "--progress=plain", "--file", str(root / image.dockerfile)]
        for ref in image.refs:
            cmd += ["--tag", ref]
        for key, value in image.build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        # Predefined proxy args: BuildKit passes them to RUN and keeps them out of history.
        for key, value in settings.proxies.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if settings.ca_bundle:
            cmd += ["--secret", f"id=ca,src={settings.ca_bundle}"]
        cmd.append(str((root / image.context).resolve()))
        return cmd

    def exists(self, ref: str) -> bool:
        probe = ["docker", "image", "inspect", ref]
        return subprocess.run(probe, capture_output=True).returncode == 0

    def image_id(self, ref: str) -> str:
        return run_text(["docker", "image", "inspect", "--format", "{{.Id}}", ref]).strip()

    def size(self, ref: str) -> int:
        return int(run_text(["docker", "image", "inspect", "--format", "{{.Size}}", ref]))

    def labels(self, ref: str) -> dict[str, str]:
        fmt = "{{json .Config.Labels}}"
        return json.loads(run_text(["docker", "image", "inspect", "--format", fmt, ref])) or {}

    def tag(self, ref: str, new_ref: str) -> None:
        run_text(["docker", "tag", ref, new_ref])

    def push(self, ref: str, auth: tuple[str, str] | None = None) -> str:
        raise AssertionError("Docker pushes go through the SDK (tools/imagetool/push.py)")

    def pull(self, ref: str) -> str:
        run_text(["docker", "pull", "--quiet", ref], timeout=3600)
        return self.image_id(ref)

    def run_command(self, ref, argv, *, user="1000:1000", volumes=(), env=None):
        cmd = ["docker", "run", "--rm", "--network", "host", "--user", user, "--entrypoint", ""]
        for volume in volumes:
            cmd += ["--volume", volume]
        for key, value in (env or {}).items():
            cmd += ["--env", f"{key}={value}"]
        return [*cmd, ref, *argv], lambda: None

    def remove(self, ref: str) -> None:
        subprocess.run(["docker", "image", "rm", "--force", ref], capture_output=True)


class BuildahEngine(Engine):
    """buildah without a daemon: chroot isolation on the host network (no user namespaces, no
    CNI needed), Docker image format so HEALTHCHECK and SHELL are kept, every step cached."""

    name = "buildah"

    def version(self) -> str:
        return run_text(["buildah", "--version"]).strip().split(" (")[0]

    def build_command(self, image: ImageBuild, root: Path, settings: BuildSettings) -> list[str]:
        cmd = [
            "buildah", "bud", "--isolation", "chroot", "--network", "host", "--layers",
            "--format", "docker", "--file", str(root / image.dockerfile),
        ]  # fmt: skip
        for ref in image.refs:
            cmd += ["--tag", ref]
        for key, value in image.build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        # buildah's --http-proxy (on by default) hands the caller's proxy variables to every
        # RUN without recording them; nothing to add for proxies.
        if settings.ca_bundle:
            cmd += ["--secret", f"id=ca,src={settings.ca_bundle}"]
        cmd.append(str((root / image.context).resolve()))
        return cmd

    def exists(self, ref: str) -> bool:
        probe = ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref]
        return subprocess.run(probe, capture_output=True).returncode == 0

    def image_id(self, ref: str) -> str:
        fmt = "{{.FromImageID}}"
        out = run_text(["buildah", "inspect", "--type", "image", "--format", fmt, ref])
        return "sha256:" + out.strip().removeprefix("sha256:")

    def size(self, ref: str) -> int:
        return int(run_text(["podman", "image", "inspect", "--format", "{{.Size}}", ref]))

    def labels(self, ref: str) -> dict[str, str]:
        out = json.loads(run_text(["buildah", "inspect", "--type", "image", ref]))
        return out.get("OCIv1", {}).get("config", {}).get("Labels") or {}

    def tag(self, ref: str, new_ref: str) -> None:
        run_text(["buildah", "tag", ref, new_ref])

    def push(self, ref: str, auth: tuple[str, str] | None = None) -> str:
        host = ref.split("/", 1)[0]
        with tempfile.TemporaryDirectory(prefix="raylift-push-") as tmp:
            digest_file = Path(tmp) / "digest"
            cmd = ["buildah", "push", "--digestfile", str(digest_file)]
            # Like Docker's default: plain HTTP only for a registry on this machine.
            if LOCAL_REGISTRY.match(host):
                cmd.append("--tls-verify=false")
            if auth:
                # An auth file readable by us only, not `--creds` (which `ps` would show).
                authfile = Path(tmp) / "auth.json"
                token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
                authfile.write_text(json.dumps({"auths": {host: {"auth": token}}}))
                authfile.chmod(0o600)
                cmd += ["--authfile", str(authfile)]
            cmd += [ref, f"docker://{ref}"]
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PushFailed(f"push of {ref} failed: {exc}") from None
            if result.returncode != 0:
                last = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise PushFailed(f"push of {ref} failed: {last[:300]}")
            return digest_file.read_text().strip()

    def pull(self, ref: str) -> str:
        cmd = ["buildah", "pull", "--quiet"]
        if LOCAL_REGISTRY.match(ref.split("/", 1)[0]):
            cmd.append("--tls-verify=false")
        out = run_text([*cmd, ref], timeout=3600).strip().splitlines()
        return "sha256:" + out[-1].removeprefix("sha256:")

    def run_command(self, ref, argv, *, user="1000:1000", volumes=(), env=None):
        # `buildah run` with chroot isolation on the host network: what works on machines
        # where podman's runtime may not set rlimits (see images/README.md).
        container = run_text(["buildah", "from", "--pull-never", ref]).strip().splitlines()[-1]
        if env:
            config = ["buildah", "config"]
            for key, value in env.items():
                config += ["--env", f"{key}={value}"]
            run_text([*config, container])
        cmd = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user", user]
        for volume in volumes:
            cmd += ["--volume", volume]
        return [*cmd, container, "--", *argv], lambda: self._rm(container)

    @staticmethod
    def _rm(container: str) -> None:
        subprocess.run(["buildah", "rm", container], capture_output=True)

    def remove(self, ref: str) -> None:
        subprocess.run(["buildah", "rmi", "--force", ref], capture_output=True)


def docker_answers(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str:
    """Empty when a Docker engine with buildx answers; otherwise why not, in a few words."""
    if shutil.which("docker") is None:
        return "no `docker` CLI on PATH"
    try:
        info = run(["docker", "version", "--format", "{{.Server.Version}}"],
                   capture_output=True, text=True, timeout=15)  # fmt: skip
        if info.returncode != 0:
            last = (info.stderr.strip().splitlines() or ["?"])[-1]
            return f"no Docker engine answers ({last[:80]})"
        bx = run(["docker", "buildx", "version"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker did not answer: {exc}"
    if bx.returncode != 0:
        return "the docker CLI has no buildx plugin (BuildKit)"
    return ""


def select_engine(
    choice: str | None = None,
    env: Mapping[str, str] = os.environ,
    docker_probe: Callable[[], str] = docker_answers,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[Engine, str]:
    """The engine to build with, and why it was picked (printed by `make image`).

    `auto` (the default, or $RAYLIFT_IMAGE_ENGINE) takes Docker BuildKit where an engine
    answers and buildah otherwise; naming one that is not usable is a one-line error.
    """
    choice = choice or env.get(ENGINE_ENV) or "auto"
    if choice not in ("auto", "docker", "buildah"):
        raise UserError(f"engine {choice!r}: pick auto, docker or buildah (${ENGINE_ENV})")
    why_not = "not asked"
    if choice in ("auto", "docker"):
        why_not = docker_probe()
        if not why_not:
            return DockerEngine(), "a Docker engine with BuildKit answers"
        if choice == "docker":
            raise EngineUnavailable(f"engine docker: {why_not}; start Docker or use buildah")
    if which("buildah") is None:
        raise EngineUnavailable(
            f"no engine to build with: {why_not}"
            " and no `buildah` on PATH; install Docker (with buildx) or `apt-get install buildah`"
        )
    reason = "asked for" if choice == "buildah" else f"{why_not}; buildah is installed"
    return BuildahEngine(), reason
