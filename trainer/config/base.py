"""What every section shares: unknown keys are errors, and the names the sections agree on."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

STRATEGIES = ("ddp", "fsdp", "deepspeed")
"""Strategies this build of the trainer implements; `trainer.strategies.base` registers them."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class _Section(BaseModel):
    """Every section rejects unknown keys: a typo must not silently become a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
