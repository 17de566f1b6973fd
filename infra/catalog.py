"""The instance facts infra needs (vCPUs, RAM, GPUs, $/hour), read from the shared data file.

infra/ stands alone (DESIGN.md): it imports nothing from trainer/. The instance catalog is a
data file, ``trainer/planner/catalog/instances.yaml``, that the planner
(``trainer.planner.catalog``) and this module each read with their own loader, so the
stack summary and the planner can never disagree about what a g5.48xlarge has or costs.
This loader keeps only the fields infra uses and ignores the rest, so the planner may add
columns without breaking a ``pulumi preview``.

A missing or broken file stops the program at preview with one line naming the file (and the
entry), never halfway through creating resources. ``RAYLIFT_INSTANCE_CATALOG`` points at
another copy (your own prices, or a test's broken file).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["CATALOG_ENV", "CATALOG_FILE", "Catalog", "CatalogError", "Instance", "load_catalog"]

CATALOG_FILE = (
    Path(__file__).resolve().parents[1] / "trainer" / "planner" / "catalog" / "instances.yaml"
)
CATALOG_ENV = "RAYLIFT_INSTANCE_CATALOG"


class CatalogError(ValueError):
    """The catalog file is missing or invalid; the message is one line naming the file."""


class Instance(BaseModel):
    """What infra needs of one EC2 instance type (per instance, per hour, USD)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    vcpus: int = Field(gt=0)
    ram_gib: float = Field(gt=0)
    gpu_count: int = Field(default=0, ge=0)
    on_demand_usd_per_hour: float = Field(gt=0)
    spot_usd_per_hour: float = Field(gt=0)

    def usd_per_hour(self, market: Literal["on-demand", "spot"]) -> float:
        return self.spot_usd_per_hour if market == "spot" else self.on_demand_usd_per_hour


class Catalog(BaseModel):
    """The file's provenance and its instance table."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    path: Path
    region: str
    as_of: str
    instances: dict[str, Instance] = Field(min_length=1)

    @property
    def display_path(self) -> str:
        """The file as the user knows it: repository-relative when it is the shared one."""
        try:
            return str(self.path.relative_to(CATALOG_FILE.parents[3]))
        except ValueError:
            return str(self.path)


def catalog_path() -> Path:
    """The file to read: $RAYLIFT_INSTANCE_CATALOG, else the shared one in the repository."""
    override = os.environ.get(CATALOG_ENV)
    return Path(override).expanduser().resolve() if override else CATALOG_FILE


def load_catalog(path: Path | None = None) -> Catalog:
    """Read and validate the catalog once per file per process."""
    return _load(path or catalog_path())


@functools.cache
def _load(path: Path) -> Catalog:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(
            f"{path}: instance catalog not found (infra/ prices and checks pools from it); "
            f"restore it from git or set {CATALOG_ENV} to your copy"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise CatalogError(f"{path}{where}: catalog is not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: instance catalog must be a mapping with `instances:`")
    try:
        return Catalog.model_validate({**raw, "path": path})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top)"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise CatalogError(f"{path}: {where}: {first['msg']}{more}") from None
