"""Lock files: exact pins, checked and regenerated for the images' platform.

Resolution is `uv pip compile` for CPython `graph.python` on x86_64 manylinux up to the
images' glibc, wheels only: uv reads each wheel's metadata (PEP 658 files, or range requests),
never the wheels themselves. What PyPI cannot answer by metadata (a +cpu local version, an
off-PyPI package, an sdist whose requirements come from setup.py) is said in graph.yaml's
`lock_check` and reported as a note.
"""

from __future__ import annotations

import collections
import email.parser
import fnmatch
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

from tools.imagetool.errors import UserError
from tools.imagetool.graph import REPO_ROOT, Graph, LockCheck, SdistCheck, build_order, chain

log = logging.getLogger("raylift.image")

LOCK_LINE_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]+)\])?==(?P<version>\S+)$"
)


def canonical(name: str) -> str:
    """PEP 503 name normalisation (what indexes, uv and lock checks compare)."""
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


# uv's --python-platform names manylinux targets from 2.17 to 2.40 (`uv pip compile --help`).
UV_MANYLINUX = range(17, 41)


def uv_platform(glibc: str) -> str:
    """The image's platform as uv names it: x86_64 manylinux up to the image's glibc, so uv
    accepts every manylinux wheel that glibc can load and none that needs a newer one."""
    minor = int(glibc.split(".")[1])
    if minor not in UV_MANYLINUX:
        raise UserError(
            f"glibc {glibc}: uv resolves for manylinux 2.{UV_MANYLINUX.start} to "
            f"2.{UV_MANYLINUX.stop - 1}; set graph.yaml's glibc within that range"
        )
    return f"x86_64-manylinux_2_{minor}"


def clean_env(prefix: str, keep: Iterable[str], extra: Mapping[str, str]) -> dict[str, str]:
    """This machine's environment less a resolver's own settings (but `keep`), plus `extra`.

    The question is "does the index serve these pins for the image's platform", so local
    find-links, extra indexes and constraint files (set by a developer or a CI image) must not
    answer it. The index URL, certificates and the cache location stay, for mirrors and CI.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefix)}
    env.update({k: os.environ[k] for k in keep if k in os.environ})
    return {**env, **extra}


def uv_env() -> dict[str, str]:
    keep = ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_CACHE_DIR", "UV_NATIVE_TLS", "UV_HTTP_TIMEOUT")
    return clean_env("UV_", keep, {"UV_NO_PROGRESS": "1"})


def pip_env() -> dict[str, str]:
    keep = ("PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT")
    return clean_env(
        "PIP_", keep, {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    )


@dataclass
class Resolution:
    """The resolver's answer: every distribution the image would install, at its version."""

    pins: dict[str, Pin]
    seconds: float


class Runner(Protocol):
    def __call__(
        self, cmd: Sequence[str], env: Mapping[str, str]
    ) -> subprocess.CompletedProcess[str]: ...


def run_command(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=dict(env), capture_output=True, text=True, timeout=900)


def uv_binary() -> str:
    """The uv the dev extra pins (its wheel ships the binary), else one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise UserError("uv is not installed: `pip install -e '.[dev]'` (it resolves the locks)")


REQUIREMENT_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def requested_extras(requirements: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Extras each requirement asks for (`ray[default,train]`), by canonical name.

    uv's output lists `ray==2.60.0` (the extras' dependencies appear as their own pins), but a
    lock must keep `ray[default,train]` so pip installs it the same way in the image."""
    extras: dict[str, set[str]] = collections.defaultdict(set)
    for line in requirements:
        match = REQUIREMENT_NAME_RE.match(line)
        if match and match[2]:
            extras[canonical(match[1])].update(e.strip() for e in match[2].split(",") if e.strip())
    return {name: tuple(sorted(found)) for name, found in extras.items()}


def resolve(
    requirements: Sequence[str],
    *,
    python: str,
    glibc: str,
    constraints: Sequence[str] = (),
    runner: Runner = run_command,
    uv: str | None = None,
) -> Resolution:
    """Resolve with `uv pip compile` for the image's platform, wheels only, metadata only.

    `--no-config` leaves out uv.toml files and pyproject settings of this machine; the
    environment is cleaned the same way (uv_env). uv reads each wheel's metadata from the
    index's PEP 658 files, or by HTTP range requests where an index lacks them, so no wheel
    is downloaded (the CUDA torch stack is several GB).
    """
    with tempfile.TemporaryDirectory(prefix="raylift-lock-") as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(requirements) + "\n")
        constraint_args: list[str] = []
        if constraints:
            constraint_file = Path(tmp) / "constraints.txt"
            constraint_file.write_text("\n".join(constraints) + "\n")
            constraint_args = ["--constraint", str(constraint_file)]
        out = Path(tmp) / "resolved.txt"
        cmd = [
            uv or uv_binary(),
            "pip",
            "compile",
            "--no-config",
            "--quiet",
            "--python-version",
            python,
            "--python-platform",
            uv_platform(glibc),
            "--only-binary",
            ":all:",
            "--no-header",
            "--no-annotate",
            "--output-file",
            str(out),
            *constraint_args,
            str(req),
        ]
        started = time.monotonic()
        result = runner(cmd, uv_env())
        seconds = time.monotonic() - started
        if result.returncode != 0:
            detail = " ".join(ln.strip() for ln in (result.stderr or "").splitlines() if ln.strip())
            detail = detail.removeprefix("error: ")
            target = f"cp{python.replace('.', '')}/glibc {glibc}"
            raise UserError(f"uv cannot resolve these pins for {target}: {detail[:600]}")
        resolved = out.read_text()
    extras = requested_extras(requirements)
    pins = {}
    for raw in resolved.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = LOCK_LINE_RE.match(line)
        if not match:
            raise UserError(f"uv answered a line that is not an exact pin: {line!r}")
        key = canonical(match["name"])
        pins[key] = Pin(match["name"], match["version"], extras.get(key, ()))
    return Resolution(pins=pins, seconds=seconds)


# pip fetches an sdist (uv has no download command). `pip download` still prepares the sdist's
# metadata in a throwaway build environment, which is most of the seconds a check of the
# trainer chains takes; no wheel is built and nothing is installed.
SELF_PIP = (sys.executable, "-m", "pip")
_SDIST_LOCK = threading.Lock()


@cache
def sdist_metadata(
    name: str, version: str, member: str | None = None, pip: tuple[str, ...] = SELF_PIP
) -> tuple[str, str]:
    """(PKG-INFO, text of `member`) of an sdist, read from the archive pip downloaded."""
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
    with _SDIST_LOCK:  # one fetch per sdist, even when several chains are checked at once
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
    """Turn pins into what uv can resolve against PyPI, with a note for each exception.

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
    graph: Graph, name: str, root: Path = REPO_ROOT, *, runner: Runner = run_command
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
    graph: Graph, root: Path, names: Iterable[str], *, runner: Runner = run_command
) -> list[Path]:
    """Regenerate lock files from the requirements inputs, parents first.

    Versions are decided once per leaf image, from all the inputs along its chain: resolving
    base alone would pick the newest python-dateutil, which boto3 in trainer cannot take.
    An image that is not regenerated (`lock --only trainer-gpu` leaves base-gpu and bnb as
    they are) enters that answer with its lock's exact pins, not its requirements input:
    its image is built already from that lock, so a child must be resolved around what the
    parent installs (otherwise the answer moves a parent's transitive pin, say virtualenv,
    and the child's resolution contradicts the parent's lock). Each image then resolves its
    own chain constrained to that answer, and its lock holds what it pulls in beyond its
    parents' locks. Images that share a lock file (trainer-gpu, trainer-cpu) are regenerated
    together and get the union; a version the chains disagree on is an error.
    """
    wanted = set(names)
    # A lock file is written whole: every image sharing it is regenerated with it.
    shared_locks = {graph.images[n].lock for n in wanted}
    wanted |= {n for n, spec in graph.images.items() if spec.lock in shared_locks}
    order = build_order(graph)
    leaves = [n for n in order if not any(s.base == n for s in graph.images.values())]
    leaf_of = {}
    solutions: dict[str, list[str]] = {}
    for leaf in leaves:
        names_in_chain = chain(graph, leaf)
        if not wanted.intersection(names_in_chain):
            continue
        merged = merged_lock_check(graph, names_in_chain)
        specs = [graph.images[n] for n in names_in_chain]
        inputs_by_node = [
            read_pins(root / (spec.requirements if n in wanted else spec.lock))
            for n, spec in zip(names_in_chain, specs, strict=True)
        ]
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
