"""A known failure rate for drills and benches (checkpoint.failure_rate_per_hour): the
cadence starts from it instead of the pool's prior, the planner's simulator does too, and
faults that come at the rate the run expects are not a burst (trainer.planner.cadence)."""

from __future__ import annotations

import math
import time

import pytest

from trainer.config import JobConfig
from trainer.planner import cadence as cad
from trainer.planner.cadence import Cadence, Costs, decide


def _for_run(records: list[dict], rate: float | None, journal=None) -> Cadence:
    got = cad.for_run(
        every_steps="auto",
        memory_every="auto",
        memory_tier=True,
        max_overhead=0.02,
        nodes=2,
        gpus_per_node=1,
        spot_band=None,
        journal_records=records,
        journal=journal,
        failure_rate_per_hour=rate,
    )
    assert got is not None
    return got


def test_a_restarted_attempt_starts_from_the_costs_its_run_journaled() -> None:
    """No measuring again from nothing at each restart (a snapshot and a storage save at
    once, then intervals too short until inflation is measured): the first decision of a
    later attempt uses the costs of the run's last journaled one."""
    log: list[dict] = []
    first = _for_run([], 2.0, journal=lambda event, **f: log.append({"event": event, **f}))
    for _ in range(Cadence.WARMUP_STEPS):
        first.step_time(1.0)
    first.saved(cad.RAM, 0.05)
    first.saved(cad.STORAGE, 2.0)
    first.decide_alone()
    before = first.decision
    assert before is not None and "measuring" not in before.reasons.values()

    def attempt(records: list[dict]) -> Cadence:
        c = _for_run(records, 2.0)
        for _ in range(Cadence.WARMUP_STEPS):
            c.step_time(1.0)
        c.decide_alone()
        return c

    again = attempt([{"event": "attempt", "time": 0.0}, *log])
    assert again.costs.storage_stall_s == pytest.approx(2.0)
    assert "measuring" not in again.decision.reasons.values()
    assert again.decision.memory_every == before.memory_every > 1
    assert again.decision.storage_every == before.storage_every > 1
    # a journal with no decision (or one this version cannot read): measure afresh
    fresh = attempt([{"event": "cadence", "costs": {"step_s": "?"}}])
    assert (fresh.decision.memory_every, fresh.decision.storage_every) == (1, 1)
    assert cad.journaled_costs([{"event": "cadence", "costs": {"step_s": 1.0}}]) is None


def test_the_rate_replaces_the_prior_and_the_rule_follows_it() -> None:
    prior = cad.prior_rates(2, 1, None)
    drill = cad.prior_rates(2, 1, None, hard_per_hour=120.0)
    # the same split as the prior's hard failures: a buddy pair's share to storage
    assert drill.memory == pytest.approx(120.0 * (1 - cad.PAIR_SHARE))
    assert drill.storage == pytest.approx(120.0 * cad.PAIR_SHARE + cad.DRIVER_FAILURES_PER_HOUR)
    assert drill.memory > 1000 * prior.memory
    run = _for_run([], 120.0)
    assert run.rates.memory == pytest.approx(drill.memory)
    # Young's interval for a kill every 30 s and a 0.01 s snapshot: √(2 · 0.01 · 31.6) s
    costs = Costs(step_s=0.05, memory_stall_s=0.01, storage_stall_s=0.01)
    d = decide(costs, run.rates, memory_tier=True, max_overhead=0.5, max_interval_s=None)
    young = math.sqrt(2 * 0.01 * 3600 / drill.memory)
    assert d.memory_every == math.ceil(young / 0.05)
    assert d.reasons[cad.RAM] == "young"


def test_faults_at_the_expected_rate_are_not_a_burst() -> None:
    now = time.time()
    kills = [{"event": "failure", "cause": "worker_died", "time": now - 60 + i} for i in (0, 30)]
    start = [{"event": "attempt", "time": now - 120}]
    assert _for_run(start + kills, None).burst  # two within 30 min, at the prior's rate
    assert not _for_run(start + kills, 120.0).burst  # 60 expected in 30 min
    assert cad.burst_faults(cad.prior_rates(64, 1, ">20%")) == cad.BURST_FAULTS
    assert cad.burst_faults(cad.prior_rates(2, 1, None, hard_per_hour=120.0)) == 120
    # the run's own faults, seen at an attempt's start, the same
    clock = [0.0]
    c = Cadence(cad.prior_rates(2, 1, None, hard_per_hour=120.0), memory_tier=True,
                clock=lambda: clock[0])  # fmt: skip
    for i in range(5):
        clock[0] = 30.0 * i
        c.fault("worker_died", 0.01, {"worker_died": i + 1})
    assert not c.burst


def test_the_config_field_and_the_plan_take_the_rate(tmp_path) -> None:
    from tests.support.jobs import llama7b_job
    from trainer.config import load_config
    from trainer.planner.faults_sim import scenario_for_plan
    from trainer.planner.plan import plan_job

    job = llama7b_job(tmp_path, strategy={"name": "fsdp"})
    cfg = load_config(job, ["checkpoint.failure_rate_per_hour=6"])
    assert cfg.checkpoint.failure_rate_per_hour == 6.0
    assert JobConfig.model_fields["checkpoint"].default_factory().failure_rate_per_hour is None
    with pytest.raises(Exception, match="failure_rate_per_hour"):
        load_config(job, ["checkpoint.failure_rate_per_hour=0"])
    s = scenario_for_plan(cfg, plan_job(cfg, "g5.4xlarge"), days=1, nodes=8)
    assert s is not None
    assert s.rates.memory + s.rates.storage == pytest.approx(6 + cad.DRIVER_FAILURES_PER_HOUR)


def test_a_storage_interval_the_user_set_is_journaled_as_set() -> None:
    """`every_steps: 25` with `memory_every: auto`: the storage tier stays 25 in the
    journaled decision (the demo's journal said 19602, the RAM tier's interval rounded up
    to a 'multiple', while the manager saved every 25)."""
    log: list[dict] = []
    c = Cadence(
        cad.prior_rates(2, 1, None),
        memory_tier=True,
        fixed_storage=25,
        max_interval_s=None,
        journal=lambda event, **f: log.append(f),
    )
    for _ in range(3):
        c.step_time(0.03)
    c.saved(cad.RAM, 0.005)
    c.decide_alone()
    assert c.decision.memory_every > 25 and c.decision.reasons[cad.STORAGE] == "fixed"
    assert c.decision.storage_every == 25 and log[-1]["storage_every"] == 25
