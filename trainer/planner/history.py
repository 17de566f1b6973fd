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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3


class Unreadable(Exception):
    """The storage path's runs could not be listed or read (what, where: one line)."""


class _LocalRuns:
    def __init__(self, root: str):
        self.root = Path(root).expanduser()

    def runs(self) -> Iterator[tuple[str, str, list[str]]]:
        """(run name, job.json's text, each device_memory/rank*.json's text), per run."""
        if not self.root.is_dir():
            return
        for job_file in sorted(self.root.glob("*/job.json")):
            run = job_file.parent
            finals = [f.read_text() for f in sorted(run.glob("device_memory/rank*.json"))]
            yield run.name, job_file.read_text(), finals


class _S3Runs:
    """The same listing over S3 with boto3: one request for the runs, two per run."""

    def __init__(self, uri: str, endpoint: str | None, region: str | None):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise Unreadable(
                f"{uri}: past runs not read (boto3 is not installed here: pip install "
                "'raylift[tools]')"
            ) from None
        self.uri = uri.rstrip("/")
        bucket, _, prefix = uri[len("s3://") :].strip("/").partition("/")
        self.bucket, self.prefix = bucket, f"{prefix}/" if prefix else ""
        style = {"addressing_style": "path"} if endpoint else {}
        conf = Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=5,
            read_timeout=20,
            s3=style,
        )
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region, config=conf)

    def _keys(self, prefix: str, folders: bool = False) -> list[str]:
        out: list[str] = []
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **({"Delimiter": "/"} if folders else {})
        )
        for page in pages:
            if folders:
                out += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            else:
                out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def _text(self, key: str) -> str:
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read().decode()

    def text(self, rel: str) -> str | None:
        """The text of `rel` under the storage path; None when there is no such object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._text(self.prefix + rel)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise Unreadable(f"{self.uri}/{rel}: not read: {exc}") from None
        except BotoCoreError as exc:
            raise Unreadable(f"{self.uri}/{rel}: not read: {exc}") from None

    def runs(self) -> Iterator[tuple[str, str, list[str]]]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for folder in self._keys(self.prefix, folders=True):
                try:
                    job = self._text(folder + "job.json")
                except ClientError:  # no job record: not a run the planner can plan again
                    continue
                finals = [
                    self._text(k)
                    for k in self._keys(folder + "device_memory/")
                    if k.rsplit("/", 1)[-1].startswith("rank") and k.endswith(".json")
                ]
                yield folder[len(self.prefix) :].rstrip("/"), job, finals
        except (BotoCoreError, ClientError) as exc:
            raise Unreadable(f"{self.uri}: past runs not read: {exc}") from None


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


def s3_text(uri: str, rel: str, endpoint: str | None, region: str | None) -> str | None:
    """An object's text under an s3:// storage path (None: no such object); Unreadable when
    S3 cannot be asked. What the planner reads beside the runs (the calibration file)."""
    return _S3Runs(uri, endpoint, region).text(rel)


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
    from trainer.config import JobConfig
    from trainer.planner.device import kind_of
    from trainer.planner.memory import Setup, rank_memory
    from trainer.planner.shape import ModelShape, shape_for_job

    if not storage or not gpu_model:
        return []
    if storage.startswith("s3://"):
        store: Any = _S3Runs(storage, endpoint_override, region)
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
