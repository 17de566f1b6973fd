"""How the planner's past predictions fared: `raylift plan` reads the runs under a local
storage path, and for each run of the same GPU kind and strategy compares what the planner
says for that run's recorded job (<run>/job.json) with the largest device-level peak its
ranks measured (<run>/device_memory/rank<N>.json, trainer.observability.device_memory).
A run that measured above its plan widens the fit margin (trainer.planner.device.margin).

Pure (standard library): runs on a laptop; an S3 storage path is not read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3


@dataclass
class PastRun:
    name: str
    gpu: str
    strategy: str
    planned: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.planned if self.planned else 0.0


def past_runs(storage: str | None, gpu_model: str | None, strategy: str) -> list[PastRun]:
    from trainer.config import JobConfig
    from trainer.planner.device import kind_of
    from trainer.planner.memory import Setup, rank_memory
    from trainer.planner.shape import ModelShape, shape_for_job

    if not storage or "://" in storage or not gpu_model or not Path(storage).is_dir():
        return []
    out = []
    for job_file in sorted(Path(storage).glob("*/job.json")):
        run = job_file.parent
        finals = [json.loads(f.read_text()) for f in sorted(run.glob("device_memory/rank*.json"))]
        gpus = {kind_of(f.get("device")) for f in finals if f.get("kind") == "cuda"}
        if gpus != {gpu_model}:
            continue
        try:
            job: dict[str, Any] = json.loads(job_file.read_text())
            cfg = JobConfig.model_validate(job["config"])
            s = Setup.from_config(cfg)
            if s.strategy != strategy:
                continue
            try:
                shape = shape_for_job(cfg)
            except Exception:
                shape = ModelShape.from_params(job["params"])
            planned = rank_memory(shape, s, gpu_model).total
        except Exception:  # a record this planner cannot plan again: not evidence
            continue
        measured = max(
            (float(v) for f in finals for k, v in f.items() if k.startswith("dev_") and v),
            default=0.0,
        )
        out.append(PastRun(run.name, gpu_model, strategy, planned, measured * GIB))
    return out


def assess(runs: list[PastRun]) -> tuple[float | None, list[str]]:
    """The largest shortfall (measured / planned - 1, when above plan) and one line each."""
    if not runs:
        return None, []
    worst = max(r.ratio for r in runs)
    lines = [
        f"history: {len(runs)} past {runs[0].strategy} run(s) on {runs[0].gpu}: measured ÷ "
        f"planned from {min(r.ratio for r in runs):.2f} to {worst:.2f}"
        + (" (above plan: the margin widens to cover it)" if worst > 1 else "")
    ]
    lines += [
        f"history:   {r.name}: planned {r.planned / GIB:.1f} GiB, measured {r.measured / GIB:.1f}"
        for r in sorted(runs, key=lambda r: -r.ratio)[:3]
    ]
    return (worst - 1 if worst > 1 else None), lines
