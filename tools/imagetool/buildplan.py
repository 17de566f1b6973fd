"""The build plan: order, tags and build args of the selected images.

A pure function of the graph, the commit and the version, so `plan` and `build --dry-run`
print exactly what a build would do, with no engine and no AWS.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.imagetool.errors import UserError
from tools.imagetool.graph import REPO_ROOT, Graph, build_order

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


def normalize_registry(registry: str) -> str:
    """Registry host as Docker wants it in a reference: no scheme, no trailing slash."""
    return re.sub(r"^https?://", "", registry.strip()).rstrip("/")


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
