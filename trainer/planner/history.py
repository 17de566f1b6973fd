"""How the planner's past predictions fared: `raylift plan` reads the runs under the
job's storage path (a local or shared-FS folder, or s3://), and for each run of the same GPU
kind and strategy compares what the planner says for that run's recorded job
(<run>/job.json) with the largest device-level peak its ranks measured
(<run>/device_memory/rank<N>.json, trainer.observability.device_memory). A run that
measured above its plan widens the fit margin (trainer.planner.device.margin).

A local path is read with the standard library alone. An s3:// path is read with boto3
(the tools extra; imported only then): pyarrow, the trainer's S3 client, is not installed
on the laptop that plans. Storage that cannot be listed is `Unreadable`: the plan says so
in one line and plans without history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainer.config import JobConfig
from trainer.planner.device import kind_of
from trainer.planner.memory import rank_memory
from trainer.planner.runstore import S3Runs
from trainer.planner.runstore import Unreadable as Unreadable
from trainer.planner.runstore import _LocalRuns as _LocalRuns
from trainer.planner.runstore import s3_text as s3_text
from trainer.planner.setup import Setup
from trainer.planner.shape import ModelShape, shape_for_job

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


def past_runs(
    storage: str | None,
    gpu_model: str | None,
    strategy: str,
    endpoint_override: str | None = None,
    region: str | None = None,
) -> list[PastRun]:
    """The runs under `storage` of this GPU kind and strategy, each planned again from its
    recorded job beside what it measured. Raises Unreadable when s3:// storage cannot be
    listed (a local folder that does not exist simply has no runs)."""
    if not storage or not gpu_model:
        return []
    if storage.startswith("s3://"):
        store: Any = S3Runs(storage, endpoint_override, region)
    elif "://" in storage:
        return []
    else:
        store = _LocalRuns(storage)
    out = []
    for name, job_text, final_texts in store.runs():
        try:
            finals = [json.loads(t) for t in final_texts]
        except ValueError:  # a torn record: not evidence
            continue
        gpus = {kind_of(f.get("device")) for f in finals if f.get("kind") == "cuda"}
        if gpus != {gpu_model}:
            continue
        try:
            job: dict[str, Any] = json.loads(job_text)
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
        out.append(PastRun(name, gpu_model, strategy, planned, measured * GIB))
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
