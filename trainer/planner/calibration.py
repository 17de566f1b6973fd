"""The calibration file `make gpu-check` writes and the planner reads: what one GPU kind,
on one software line, measured outside the tensors (CUDA context, NCCL per communicator,
the allocator's slack per strategy) and how far the planner's device-level total was from
the measured device peak per strategy.

Pure (standard library): the planner reads it on a laptop.

    {"format": 1, "gpu_name": "NVIDIA H200", "gpu_model": "H200", "torch": "2.13.0+cu130",
     "cuda": "13.0", "nccl": "2.28.3", "date": "2026-11-29",
     "context_bytes": 6.1e8, "nccl_bytes_per_communicator": 2.6e8,
     "strategies": {"ddp": {"slack_fraction": 0.03, "expandable_segments": true,
                            "predicted": 6.4e9, "measured": 6.1e9, "error": 0.05}}}

`error` is |predicted - measured| / measured of the device-level peak: the planner's fit
margin for that strategy is at least it (trainer.planner.device.margin).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.planner import runstore

FORMAT = 1
FILE_NAME = "calibration.json"
CALIBRATION_DIR = "_calibration"
"""Under a storage path: <storage.path>/_calibration/<gpu_model>.json, beside the runs."""


@dataclass
class StrategyCalibration:
    slack_fraction: float | None = None
    """Measured device peak less the modelled tensors, context, NCCL and workspaces, as a
    share of the modelled tensors: the allocator's fragmentation for this strategy."""
    expandable_segments: bool = True
    predicted: float | None = None
    measured: float | None = None
    error: float | None = None


@dataclass
class Calibration:
    gpu_name: str
    gpu_model: str
    torch: str = ""
    cuda: str = ""
    nccl: str = ""
    date: str = ""
    context_bytes: float | None = None
    nccl_bytes_per_communicator: float | None = None
    strategies: dict[str, StrategyCalibration] = field(default_factory=dict)
    source: str = ""
    """Where it was read from (not written)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> Calibration:
        if d.get("format") != FORMAT:
            raise UserError(
                f"{source or 'calibration'}: format {d.get('format')!r}, this planner reads "
                f"format {FORMAT}; rerun `make gpu-check` to write a new one"
            )
        try:
            strategies = {
                k: StrategyCalibration(**v) for k, v in (d.get("strategies") or {}).items()
            }
            fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "strategies"}
            return cls(**{**fields, "strategies": strategies, "source": source})
        except TypeError as exc:
            raise UserError(f"{source or 'calibration'}: not a calibration file ({exc})") from None

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))
        tmp.replace(path)
        return path

    def for_strategy(self, strategy: str) -> StrategyCalibration | None:
        return self.strategies.get(strategy)


def read(path: str | os.PathLike[str]) -> Calibration:
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"--calibration {p}: no such file") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{p}: not JSON ({exc.msg}, line {exc.lineno})") from None
    return Calibration.from_dict(raw, str(p))


def find(
    storage: str | None,
    gpu_model: str | None,
    endpoint_override: str | None = None,
    region: str | None = None,
) -> Calibration | None:
    """The calibration beside the storage path's runs for this GPU kind, if any (an s3://
    path through trainer.planner.runstore's reader; one it cannot read has none)."""
    if storage and gpu_model and storage.startswith("s3://"):
        rel = f"{CALIBRATION_DIR}/{gpu_model}.json"
        try:
            text = runstore.s3_text(storage, rel, endpoint_override, region)
        except runstore.Unreadable:  # the plan's history line says so
            return None
        if text is None:
            return None
        where = f"{storage.rstrip('/')}/{rel}"
        try:
            return Calibration.from_dict(json.loads(text), where)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not storage or "://" in storage or not gpu_model:
        return None
    p = Path(storage) / CALIBRATION_DIR / f"{gpu_model}.json"
    return read(p) if p.is_file() else None
