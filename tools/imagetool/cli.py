"""The command line: `python tools/image.py build|plan|push|lock`, verbs over the modules."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tools.imagetool.build import EngineImages, docker_client, run_build
from tools.imagetool.buildplan import (
    GitInfo,
    Plan,
    format_plan,
    git_info,
    make_plan,
    project_version,
)
from tools.imagetool.console import setup_logging
from tools.imagetool.engine import (
    BuildSettings,
    DockerEngine,
    Engine,
    select_engine,
    staged_wheelhouse,
)
from tools.imagetool.errors import UserError
from tools.imagetool.graph import DEFAULT_GRAPH, REPO_ROOT, Graph, build_order, load_graph
from tools.imagetool.locks import check_locks, write_locks
from tools.imagetool.osimage import DEFAULT_OS_TAG, make_os_image
from tools.imagetool.push import (
    PULUMI_REPOSITORIES_OUTPUT,
    REGISTRY_ENV,
    TAG_FILE,
    resolve_registry,
    run_push,
    run_push_engine,
    verify_pushed,
    write_tag_file,
)

log = logging.getLogger("raylift.image")
DESCRIPTION = "Build, push and lock Raylift's training images, as described by images/graph.yaml."


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", metavar="LAYER", help="one layer (base, bnb, ccl, trainer) or image")
    p.add_argument("--variant", choices=("gpu", "cpu", "ccl"), help="only this variant's images")
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
    # `raylift image` names itself in argv[0] (tools/cli.py); the script keeps its path.
    prog = sys.argv[0] if sys.argv[0].startswith("raylift") else "tools/image.py"
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, parents=[_global_options(True)]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for command, help_text in (
        ("build", "build the images in dependency order"),
        ("plan", "print the build plan (order, tags, args); needs no engine"),
        ("check", "build as far as this machine can, say where it stopped, import-check"),
    ):
        p = sub.add_parser(command, parents=[_global_options(False)], help=help_text)
        _add_selection(p)
        p.add_argument("--registry", help="prefix tags with this registry host")
        p.add_argument("--build-arg", action="append", default=[], metavar="[NAME:]K=V",
                       help="override a build arg, for all images or one image/layer")  # fmt: skip
        _add_sources(p)
        if command == "check":
            p.add_argument("--engine", choices=("auto", "docker", "buildah"))
            p.add_argument("--ca-bundle", type=Path)
            p.add_argument("--wheelhouse", type=Path)
        if command == "build":
            p.add_argument("--dry-run", action="store_true", help="print the plan, build nothing")
            p.add_argument("--engine", choices=("auto", "docker", "buildah"),
                           help="build engine (default: $RAYLIFT_IMAGE_ENGINE, then auto: "
                           "BuildKit where an engine answers, else buildah)")  # fmt: skip
            p.add_argument("--ca-bundle", type=Path,
                           help="CA bundle the build's downloads trust, passed as a build secret "
                           "(default: $RAYLIFT_CA_BUNDLE, $SSL_CERT_FILE, system)")  # fmt: skip
            p.add_argument("--wheelhouse", type=Path,
                           help="folder of wheels pip may install from (--find-links), e.g. a "
                           "CPU torch where PyTorch's index is out of reach")  # fmt: skip

    p = sub.add_parser(
        "os-image", parents=[_global_options(False)],
        help="make a Debian 12 OS image with mmdebstrap (where debian:bookworm-slim cannot be "
        "pulled)",
    )  # fmt: skip
    p.add_argument("--tag", default=DEFAULT_OS_TAG, help="local tag of the OS image")
    p.add_argument("--cache", type=Path, help="keep the root filesystem tarball here")
    p.add_argument("--mirror", help="Debian mirror URL (default: mmdebstrap's)")

    p = sub.add_parser(
        "push", parents=[_global_options(False)], help="push built images to the registry"
    )
    _add_selection(p)
    p.add_argument("--registry", help=f"registry host (default: ${REGISTRY_ENV}, then Pulumi)")
    p.add_argument("--region", help="AWS region of ECR (default: from the registry host)")
    p.add_argument("--dry-run", action="store_true", help="print what would be pushed")
    p.add_argument("--engine", choices=("auto", "docker", "buildah"), help="as for build")
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


def _add_sources(p: argparse.ArgumentParser) -> None:
    """Where a build gets its OS image and wheels: production defaults in graph.yaml,
    overridable per build for machines that cannot reach them."""
    p.add_argument("--os-image", help="OS image of the base images (default: graph.yaml's "
                   "debian:bookworm-slim); `os-image` makes one with mmdebstrap")  # fmt: skip
    p.add_argument("--index-url", help="a PyPI mirror to use instead of PyPI (no credentials "
                   "in the URL: they would land in the image history)")  # fmt: skip
    p.add_argument("--torch-index-url", help="where +cpu torch wheels come from (default: "
                   "PyTorch's CPU index; '' for none, with --wheelhouse)")  # fmt: skip


def source_build_args(args: argparse.Namespace) -> list[str]:
    """The --os-image / --index-url / --torch-index-url settings as scoped build args."""
    out = []
    if getattr(args, "os_image", None):
        out.append(f"base:OS_IMAGE={args.os_image}")
    for flag, value, arg in (
        ("--index-url", getattr(args, "index_url", None), "PIP_INDEX_URL"),
        ("--torch-index-url", getattr(args, "torch_index_url", None), "base:TORCH_INDEX_URL"),
    ):
        if value is None:
            continue
        if re.match(r"^[a-z+]+://[^/@]+@", value):
            raise UserError(
                f"{flag} {re.sub(r'//[^/@]+@', '//***@', value)}: the URL holds credentials, "
                "which would be "
                "recorded in the image history; use a mirror that needs none here"
            )
        out.append(f"{arg}={value}")
    return out


def _plan_from_args(args: argparse.Namespace, graph: Graph, registry: str | None) -> Plan:
    git = GitInfo(sha=args.git_sha) if args.git_sha else git_info()
    return make_plan(
        graph,
        version=args.version or project_version(),
        git=git,
        registry=registry,
        only=args.only,
        variant=args.variant,
        build_args=[*source_build_args(args), *getattr(args, "build_arg", [])],
    )


def run(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph, REPO_ROOT)
    out = sys.stdout
    if args.command == "os-image":
        out.write(make_os_image(args.tag, cache=args.cache, mirror=args.mirror) + "\n")
        return 0
    if args.command == "plan" or (args.command == "build" and args.dry_run):
        plan = _plan_from_args(args, graph, args.registry)
        out.write(format_plan(plan) + "\n")
        if args.command == "plan":
            _write_sizes(plan, None, out)
        return 0
    if args.command == "build":
        plan = _plan_from_args(args, graph, args.registry)
        settings = BuildSettings.from_env(args.ca_bundle)
        engine, why = select_engine(args.engine)
        log.info("engine: %s %s (%s)", engine.name, engine.version(), why)
        out.write(f"engine: {engine.name}\n")
        client = docker_client() if isinstance(engine, DockerEngine) else EngineImages(engine)
        with staged_wheelhouse(REPO_ROOT, args.wheelhouse):
            seconds = run_build(plan, REPO_ROOT, client, engine=engine, settings=settings)
        _write_sizes(plan, engine, out, seconds)
        return 0
    if args.command == "check":
        return run_check(_plan_from_args(args, graph, args.registry), args, out)
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
        engine, why = select_engine(args.engine)
        log.info("engine: %s (%s)", engine.name, why)
        if isinstance(engine, DockerEngine):
            pushed = run_push(plan, docker_client(), region=args.region, attempts=args.attempts)
            for image in plan.images:  # pull each exact tag back by digest
                digest = dict(pushed).get(image.ref)
                if digest:
                    verify_pushed(engine, image.ref, digest)
        else:
            pushed = run_push_engine(plan, engine, region=args.region, attempts=args.attempts)
        for ref, digest in pushed:
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


# Imports every module of the trainer package and bitsandbytes (where installed): what a node
# would do at the first step, without a GPU (bitsandbytes then warns, but must import).
IMPORT_CHECK = """
import importlib, importlib.util, pkgutil, trainer
names = [m.name for m in pkgutil.walk_packages(trainer.__path__, "trainer.")]
for name in names:
    importlib.import_module(name)
extra = [n for n in ("bitsandbytes", "deepspeed") if importlib.util.find_spec(n)]
for name in extra:
    importlib.import_module(name)
print(f"imported {len(names)} trainer modules and {', '.join(extra)}")
"""


def run_check(plan: Plan, args: argparse.Namespace, out: TextIO) -> int:
    """Build image by image until one fails; report what built, where it stopped, and
    import-check the last image that has the trainer in it."""
    from tools.imagetool.errors import BuildFailed

    settings = BuildSettings.from_env(args.ca_bundle)
    engine, why = select_engine(args.engine)
    out.write(f"engine: {engine.name} ({why})\n")
    client = docker_client() if isinstance(engine, DockerEngine) else EngineImages(engine)
    built: list[str] = []
    failed = None
    for image in plan.images:
        one = Plan(images=(image,), version=plan.version, git=plan.git, registry=plan.registry)
        try:
            with staged_wheelhouse(REPO_ROOT, args.wheelhouse):
                seconds = run_build(one, REPO_ROOT, client, engine=engine, settings=settings)
        except BuildFailed as exc:
            failed = f"{image.name}: {exc}"
            break
        built.append(image.name)
        size = human_bytes(engine.size(image.ref))
        out.write(f"built: {image.name} {size} in {seconds[image.name]:.0f} s\n")
    if failed:
        out.write(f"stopped: {failed}\n")
        rest = [i.name for i in plan.images if i.name not in built][1:]
        if rest:
            out.write(f"not attempted: {', '.join(rest)}\n")
    trainer_images = [i for i in plan.images if i.name in built and i.layer == "trainer"]
    if trainer_images:
        import subprocess

        cmd, cleanup = engine.run_command(trainer_images[-1].ref, ["python", "-c", IMPORT_CHECK])
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        finally:
            cleanup()
        last = result.stdout.strip().splitlines() or result.stderr.strip().splitlines() or [""]
        out.write(f"import check in {trainer_images[-1].name}: {last[-1]}\n")
        if result.returncode != 0:
            return 1
    return 1 if failed else 0


def human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _write_sizes(
    plan: Plan, engine: Engine | None, out: TextIO, seconds: dict[str, float] | None = None
) -> None:
    """Each image's size (and build time) where it exists locally; silent without an engine."""
    if engine is None:
        try:
            engine, _ = select_engine()
        except UserError:
            return
    for image in plan.images:
        if not engine.exists(image.ref):
            continue
        took = f", built in {seconds[image.name]:.0f} s" if seconds else ""
        out.write(f"size: {image.name} {human_bytes(engine.size(image.ref))}{took}\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.debug)
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
