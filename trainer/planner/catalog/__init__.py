"""The EC2 instance spec-and-price catalog, as typed data.

One YAML file (``instances.yaml`` beside this module) is the single source of instance facts:
``infra/`` prices its stack summary from it and ``trainer.planner`` sizes memory and cost from
it, so the two can never disagree about how much RAM a g5.48xlarge has or what it costs.

This module is deliberately pure (pydantic + PyYAML, no torch, no Ray, no boto3) so a laptop
can import it to plan a job, and it reads the file through ``importlib.resources`` so it works
the same from a source checkout, an installed wheel or a zipped package.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Catalog", "InstanceType", "get_instance", "load_catalog", "load_instances"]

Family = Literal["gpu", "general", "memory", "compute"]


class InstanceType(BaseModel):
    """Specs and prices of one EC2 instance type (per instance, per hour, in USD)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    family: Family
    vcpus: int = Field(gt=0)
    ram_gib: float = Field(gt=0)
    gpu_model: str | None = None
    gpu_count: int = Field(default=0, ge=0)
    gpu_memory_gib: float = Field(default=0, ge=0, description="memory of ONE GPU")
    nvme_gb: float = Field(
        default=0, ge=0, description="instance-store NVMe, all devices together (GB)"
    )
    nvme_devices: int = Field(default=0, ge=0)
    on_demand_usd_per_hour: float = Field(gt=0)
    spot_usd_per_hour: float = Field(gt=0, description="typical, not a quote")
    spot_interruption_band: Literal["<5%", "5-10%", "10-15%", "15-20%", ">20%"] | None = Field(
        default=None,
        description="AWS's spot interruption frequency band (share interrupted per month): "
        "the prior of the checkpoint cadence (trainer.planner.cadence)",
    )

    @model_validator(mode="after")
    def _gpu_fields_agree(self) -> InstanceType:
        # A half-filled GPU entry would make the planner silently treat a GPU node as CPU-only.
        has_gpu = self.gpu_count > 0
        if has_gpu != (self.gpu_model is not None) or has_gpu != (self.gpu_memory_gib > 0):
            raise ValueError(
                f"{self.name}: gpu_model, gpu_count and gpu_memory_gib must be all set or all unset"
            )
        if (self.nvme_gb > 0) != (self.nvme_devices > 0):
            raise ValueError(f"{self.name}: nvme_gb and nvme_devices must be both set or unset")
        if self.spot_usd_per_hour > self.on_demand_usd_per_hour:
            raise ValueError(f"{self.name}: typical spot price exceeds the on-demand price")
        return self

    def usd_per_hour(self, market: Literal["on-demand", "spot"]) -> float:
        """Price for the market a pool buys in, so callers don't branch on field names."""
        return self.spot_usd_per_hour if market == "spot" else self.on_demand_usd_per_hour


class Catalog(BaseModel):
    """The whole file: provenance plus the instance table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    as_of: str
    region: str
    instances: dict[str, InstanceType]


@functools.cache
def load_catalog() -> Catalog:
    """Parse and validate ``instances.yaml`` once per process (the file ships with the package)."""
    text = resources.files(__package__).joinpath("instances.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    # The YAML keys are the instance names; copy them into each entry so a spec knows its name.
    raw["instances"] = {name: {"name": name, **spec} for name, spec in raw["instances"].items()}
    return Catalog.model_validate(raw)


def load_instances() -> dict[str, InstanceType]:
    """All instance types by name (a fresh dict; the specs themselves are immutable)."""
    return dict(load_catalog().instances)


def get_instance(name: str) -> InstanceType:
    """One instance type, with a one-line error that says where to add a missing one."""
    try:
        return load_catalog().instances[name]
    except KeyError:
        raise KeyError(
            f"instance type {name!r} is not in trainer/planner/catalog/instances.yaml; "
            "add its specs and prices there"
        ) from None
