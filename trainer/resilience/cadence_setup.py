"""The run's cadence component, built from the job, the runtime and the run's failure
journal (the loop's side of `trainer.planner.cadence`, which stays pure for the planner
and its simulator). It lives beside the journal it reads and the attempt's start that
builds it, above the checkpoint package, whose cadence it configures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.planner import fault_history
from trainer.planner.cadence import Cadence, for_run, memory_tier_on, spot_band_of
from trainer.resilience import journal as journal_mod


def for_job(cfg: Any, rt: Any, past_runs: dict[str, Any] | None = None) -> Cadence | None:
    """The run's cadence (None when both intervals are numbers, or in a smoke test).
    `past_runs`: what the driver read of the other runs under storage.path
    (fault_history.Reading.to_dict, `Prepared.past_faults`); their faults on this rank's
    pool move the rates, unless the job states its rate (checkpoint.failure_rate_per_hour)."""
    if cfg.train.as_test:
        return None
    labels = dict(getattr(rt, "node_labels", {}) or {})
    pool = fault_history.pool_record(labels, rt.world_size)
    try:
        records = journal_mod.read(rt.run)
    except Exception:  # a journal that cannot be read leaves the priors
        records = []
    reading = fault_history.Reading.from_dict(past_runs)
    stated = cfg.checkpoint.failure_rate_per_hour is not None
    past = (
        fault_history.PastFaults()
        if stated
        else reading.for_pool(pool["instance_type"], pool["market"])
    )
    journal = rt.journal.add if getattr(rt, "journal", None) is not None else None
    if journal is not None:
        evidence = {
            "pool": fault_history.pool_key(pool["instance_type"], pool["market"]),
            **past.record(pool["nodes"]),
            "past_skipped": len(reading.skipped),
        }
        if stated:
            evidence["past_ignored"] = "checkpoint.failure_rate_per_hour is set"
        if reading.note:
            evidence["past_note"] = reading.note
        journal = _first_decision_with(journal, evidence)
    cadence = for_run(
        every_steps=cfg.checkpoint.every_steps,
        memory_every=cfg.checkpoint.memory_every,
        memory_tier=memory_tier_on(cfg, getattr(rt, "under_ray", False)),
        max_overhead=cfg.checkpoint.max_overhead,
        max_interval_s=cfg.checkpoint.max_interval_s,
        failure_rate_per_hour=cfg.checkpoint.failure_rate_per_hour,
        nodes=pool["nodes"],
        gpus_per_node=pool["gpus_per_node"],
        spot_band=spot_band_of(labels),
        journal_records=records,
        journal=journal,
        past=(past.faults, past.job_hours(pool["nodes"])),
    )
    if cadence is not None and hasattr(rt, "on_persisted"):
        rt.on_persisted = cadence.written  # the write floor
        rt.on_blocked = cadence.blocked  # a step's time without the uploads' waits
        # a storage checkpoint due while an upload is in flight waits for it, training on
        cadence.upload_in_flight = lambda: rt.uploads_in_flight() > 0
    return cadence


def _first_decision_with(
    journal: Callable[..., Any], evidence: dict[str, Any]
) -> Callable[..., Any]:
    """The journal, with what moved the rates added to this attempt's first cadence
    decision (`rates_from`): the past runs counted, their node-hours, faults per tier."""
    pending = [evidence]

    def add(event: str, **fields: Any) -> Any:
        if event == "cadence" and pending:
            fields["rates_from"] = pending.pop()
        return journal(event, **fields)

    return add
