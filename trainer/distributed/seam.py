"""The `Runtime` seam: what the loop, the attempt's start, `Publish` and the evaluation
see of where they run, whether Ray Train or torchrun started them.

It is a Protocol, not the runtimes' base class, so that it sits low in the import graph:
the runtimes (`trainer.runtime.worker`) use the checkpoint uploads and the failure journal,
and the components that take a runtime as a parameter sit below both. A runtime satisfies
it by its shape; nothing here imports Ray, the checkpoint package or the journal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from trainer.storage.location import Location


class Runtime(Protocol):
    """One worker's runtime (`trainer.runtime.worker.RayRuntime` or `TorchrunRuntime`)."""

    rank: int
    world_size: int
    local_rank: int
    run: Location  # the run's folder in storage: checkpoints, journal, metrics
    node_labels: dict[str, str]
    # Rank 0's failure journal (trainer.resilience.journal.Journal), else None; typed
    # loosely so that this seam stays below the package that defines it.
    journal: Any
    # Ray Train started this worker (the RAM tier, Ray's gauges and its checkpoint
    # registration exist only there); False under torchrun.
    under_ray: bool
    on_persisted: Callable[..., Any] | None
    on_blocked: Callable[..., Any] | None

    def latest_checkpoint(self) -> Path | None: ...

    def report(
        self, metrics: dict[str, Any], step: int, ckpt_dir: Path | None, kind: str = "periodic"
    ) -> bool: ...

    def uploads_in_flight(self) -> int: ...

    def wait_uploads(self) -> None: ...

    def finish(self) -> None: ...

    def preemption(self) -> dict[str, Any] | None: ...

    def wait_out_preemption(self, deadline_s: float | None) -> None: ...

    def note_save(self, step: int, seconds: float) -> None: ...

    def release_fetched(self) -> None: ...

    def barrier(self) -> None: ...
