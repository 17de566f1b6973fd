"""`make demo` (`raylift demo`, `python -m tools.demo`): the production path end to end on
this machine. `cli` runs it (assets, a local Ray cluster, submit, follow, report), `job`
is the job it submits, `promises` what it checks on what the run left behind, `gsm8k` the
GSM8K-shaped data of the RL benchmark.

The names below load on first use: importing `tools.demo.gsm8k` alone does not pull in
the demo's CLI (Ray, the job client), ~2 s of imports."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "main": "tools.demo.cli",
    "JOB": "tools.demo.job",
    "broken_promises": "tools.demo.promises",
}

__all__ = ["JOB", "broken_promises", "main"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
