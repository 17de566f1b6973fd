"""The run's cadence component, built from the job and the runtime (the loop's side of
`trainer.checkpoint.cadence`, which stays pure for the planner and its simulator)."""

from __future__ import annotations

import math
from typing import Any

from trainer.checkpoint.cadence import (
    INSTANCE_TYPE_LABELS,
    Cadence,
    for_run,
    memory_tier_on,
    spot_band_of,
)


def for_job(cfg: Any, rt: Any) -> Cadence | None:
    """The run's cadence (None when both intervals are numbers, or in a smoke test)."""
    if cfg.train.as_test:
        return None
    from trainer.planner.catalog import load_instances
    from trainer.resilience import journal as journal_mod
    from trainer.runtime.worker import RayRuntime

    labels = dict(getattr(rt, "node_labels", {}) or {})
    itype = next((labels[k] for k in INSTANCE_TYPE_LABELS if labels.get(k)), "")
    spec = load_instances().get(itype)
    per_node = max(1, spec.gpu_count) if spec is not None else 1
    try:
        records = journal_mod.read(rt.run)
    except Exception:  # a journal that cannot be read leaves the priors
        records = []
    cadence = for_run(
        every_steps=cfg.checkpoint.every_steps,
        memory_every=cfg.checkpoint.memory_every,
        memory_tier=memory_tier_on(cfg, isinstance(rt, RayRuntime)),
        max_overhead=cfg.checkpoint.max_overhead,
        max_interval_s=cfg.checkpoint.max_interval_s,
        failure_rate_per_hour=cfg.checkpoint.failure_rate_per_hour,
        nodes=math.ceil(rt.world_size / per_node),
        gpus_per_node=per_node,
        spot_band=spot_band_of(labels),
        journal_records=records,
        journal=rt.journal.add if getattr(rt, "journal", None) is not None else None,
    )
    if cadence is not None and hasattr(rt, "on_persisted"):
        rt.on_persisted = cadence.written
    return cadence
