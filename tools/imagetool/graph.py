"""images/graph.yaml, typed and validated. This is the only code that reads the graph file.

Pydantic checks the shape; validate_graph checks what it cannot (references, cycles, files on
disk, build args a Dockerfile declares), so every problem is one line naming file and key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tools.imagetool.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GRAPH = REPO_ROOT / "images" / "graph.yaml"

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
    variant: Literal["gpu", "cpu", "ccl"]
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
