"""`checkpoint:` and `storage:` what is saved when, and where runs live."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from trainer.config.base import _Section


class CheckpointSection(_Section):
    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description="Steps between resume checkpoints in storage. auto: chosen by the run "
        "from the measured save cost and the failures storage must cover, and chosen again "
        "as they move (docs/checkpoints.md); null = only at the end.",
    )
    max_overhead: float = Field(
        default=0.02,
        gt=0,
        lt=1,
        description="With auto intervals, the share of training time a tier's checkpoints may "
        "stall it: a measured stall above it lengthens that tier's interval.",
    )
    failure_rate_per_hour: float | None = Field(
        default=None,
        gt=0,
        description="With auto intervals, hard failures per hour of the whole job (worker "
        "kills, nodes lost without notice) that the cadence starts from, instead of the "
        "prior (the pool's spot band and the hardware rate). For fault drills and "
        "benchmarks whose faults come at a known rate; null = the prior.",
    )
    max_interval_s: float | None = Field(
        default=1800.0,
        gt=0,
        description="With auto intervals, the longest a tier's interval may run, in seconds "
        "of training (the storage interval, and so the RAM tier's, of which it is a "
        "multiple): a fault the failure-rate priors did not expect then loses at most this "
        "much of the cluster's work; at the default a 5 s storage save stalls 0.3 % of the "
        "time. Wins over max_overhead, never over the write floor. null = no cap.",
    )
    keep_last: int = Field(default=3, ge=1, description="Complete checkpoints kept; older pruned.")
    export_every: int | None = Field(
        default=None,
        ge=1,
        description="Steps between Hugging Face exports (export/step_<N>/); the end of the run "
        "always exports. null = only at the end.",
    )
    allow_restart_from_scratch: bool = Field(
        default=False,
        description="If the run folder holds only torn checkpoints, train from step 0 "
        "(with a warning) instead of stopping with an error that names them.",
    )
    upload: Literal["async", "sync"] = Field(
        default="async",
        description="async: training goes on while a checkpoint uploads (Ray Train); a "
        "checkpoint counts only once its upload completed and verified. sync: wait.",
    )
    max_uploads_in_flight: int = Field(
        default=1,
        ge=1,
        description="Async uploads queued or running at once; a checkpoint due beyond it waits.",
    )
    background_idle: bool = Field(
        default=True,
        description="The threads that write and upload checkpoints in the background (and "
        "the transfer threads they start) run under Linux's SCHED_IDLE policy: they get a "
        "core only when training leaves one idle, and never preempt it. false: only "
        "background_nice lowers them.",
    )
    background_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Nice value of the threads that write and upload checkpoints in the "
        "background (and the transfer threads they start), so they take the CPU only when "
        "training leaves it idle; 0 keeps training's priority.",
    )
    stuck_write_s: float = Field(
        default=600.0,
        ge=0,
        description="A background checkpoint write that adds no byte to its folder for "
        "this long counts as hung (a stuck file system, a save waiting on a lost peer): "
        "the attempt fails with an error naming the step, and the run restarts from the "
        "last complete checkpoint instead of idling. 0: wait forever.",
    )
    upload_retry_s: float = Field(
        default=300.0,
        ge=0,
        description="How long an upload retries transient storage errors (throttling, a "
        "server briefly down) with backoff before the attempt fails.",
    )
    memory_every: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="Steps between snapshots of the resume state to the RAM tier: keepers "
        "(one Ray actor per node) hold the newest complete snapshot in host memory, each "
        "copied to a buddy keeper on another node, so a hard kill (a SIGKILLed worker, an "
        "OOM kill, a node lost without notice) restores from memory and loses at most a "
        "step or two instead of a checkpoint interval. 0 = off. auto (the default): on, "
        "at the interval the run chooses from the measured snapshot cost and the rate of "
        "hard kills, for Ray Train runs with DDP, FSDP and adapters; off with DeepSpeed "
        "(a number there is refused at preflight) and under torchrun.",
    )

    @property
    def memory_tier(self) -> bool:
        """Whether the RAM tier may be on (a number > 0, or auto); the runtime and the
        strategy decide the rest (trainer.planner.cadence.memory_tier_on)."""
        return self.memory_every == "auto" or self.memory_every > 0


class StorageSection(_Section):
    path: str = Field(
        default="./runs", description="Local dir, shared-FS dir, or s3://bucket/prefix."
    )
    endpoint_override: str | None = Field(
        default=None, description="S3-compatible endpoint, e.g. http://127.0.0.1:8333."
    )
    region: str | None = Field(default=None, description="S3 region (else AWS_REGION).")

    @property
    def is_s3(self) -> bool:
        return self.path.startswith("s3://")
