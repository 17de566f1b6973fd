"""`scaling:` workers, their resources and the collective backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainer.config.base import _Section


class ScalingSection(_Section):
    num_workers: int | tuple[int, int] = Field(
        default=2,
        description="Ray Train workers (one per GPU), or [min, max] for elastic training: "
        "the run goes on with fewer workers after losing nodes and grows back when they "
        "return; the global batch stays that of max workers (grad_accum adapts).",
    )
    elastic_resize_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="Elastic runs: seconds between checks for returned capacity to grow into.",
    )
    use_gpu: bool = Field(
        default=False, description="One GPU per worker unless resources say more."
    )
    resources_per_worker: dict[str, float] | None = Field(
        default=None, description='Ray resources per worker, e.g. {"CPU": 8, "GPU": 1}.'
    )
    backend: Literal["auto", "gloo", "nccl", "ccl"] = Field(
        default="auto", description="auto: nccl with GPUs, gloo without."
    )
    rank0_label: dict[str, str] | None = Field(
        default_factory=lambda: {"large_cpu_mem": "true"},
        description="Put rank 0 on a node with these labels when the cluster has one.",
    )
    expandable_segments: bool = Field(
        default=True,
        description="GPU workers: PyTorch's allocator grows one segment per stream instead "
        "of caching fixed ones (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set unless "
        "you set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF yourself), which removes most "
        "fragmentation; the planner's allocator slack follows it. Turn off with CUDA graphs, "
        "NCCL user-buffer registration or CUDA IPC sharing of tensors (docs: planning).",
    )

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(v, tuple):
            lo, hi = v
            if not 1 <= lo <= hi:
                raise ValueError(f"[min, max] needs 1 <= min <= max, got [{lo}, {hi}]")
            return lo if lo == hi else (lo, hi)
        if v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers
