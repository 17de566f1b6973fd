"""`run:` and `tracking:` the run's name and the trackers it reports to."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.base import _Section


class RunSection(_Section):
    name: str = Field(description="Run name; same name + storage = resume.")
    max_failures: int = Field(
        default=3, ge=-1, description="Worker-group restarts allowed; -1 = forever."
    )
    max_preemptions: int = Field(
        default=-1,
        ge=-1,
        description="Restarts after spot preemptions (counted apart from failures); -1 = forever.",
    )


class MlflowTracking(_Section):
    tracking_uri: str = Field(
        description="MLflow tracking server (http://host:5000) or store URI (sqlite:///path.db); "
        "credentials come from MLFLOW_TRACKING_TOKEN / _USERNAME / _PASSWORD (submit --env)."
    )
    experiment: str = Field(
        default="raylift", description="Experiment the run goes into (created if missing)."
    )


class WandbTracking(_Section):
    project: str = Field(description="W&B project.")
    entity: str | None = Field(default=None, description="W&B team or user; null = yours.")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: write run files only (copied to <run>/wandb/; `wandb sync` "
        "them later). online needs WANDB_API_KEY in the job's env (submit --env).",
    )


class TensorBoardTracking(_Section):
    dir: str | None = Field(
        default=None,
        description="Event-file folder; null = <storage>/<run>/tensorboard (survives the "
        "cluster; S3 runs are uploaded at each checkpoint and at the end).",
    )


class TrackingSection(_Section):
    """Experiment trackers; any combination. Only rank 0 talks to them, from background
    threads: a tracker that is down or slow never stops training."""

    mlflow: MlflowTracking | None = Field(default=None, description="Log to MLflow.")
    wandb: WandbTracking | None = Field(default=None, description="Log to Weights & Biases.")
    tensorboard: TensorBoardTracking | None = Field(
        default=None, description="Write TensorBoard event files (`tensorboard: {}` is enough)."
    )
    per_rank_every: int = Field(
        default=10,
        ge=1,
        description="Logged steps between records of every rank's memory and step times "
        "(every logged step has their min/mean/max and the max's rank).",
    )
    buffer: int = Field(
        default=100_000,
        ge=100,
        description="Points a tracker may hold while it is unreachable; older ones are dropped "
        "from it (never from metrics.jsonl) and counted at the end.",
    )
    ray_metrics: bool = Field(
        default=True,
        description="Export per-worker memory and step times as Ray metrics (dashboard, "
        "Prometheus scrape of the cluster).",
    )
    close_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="At the end of an attempt, seconds the trackers get for their last sends "
        "(a failed attempt gets at most 10); what is still unsent then is counted, and the "
        "next attempt resends it from metrics.jsonl.",
    )

    @field_validator("tensorboard", mode="before")
    @classmethod
    def _tensorboard_shorthand(cls, v: Any) -> Any:
        """`tensorboard: true` means the default folder; `false` means off."""
        if isinstance(v, bool):
            return {} if v else None
        return v

    @property
    def trackers(self) -> list[str]:
        return [n for n in ("mlflow", "wandb", "tensorboard") if getattr(self, n) is not None]
