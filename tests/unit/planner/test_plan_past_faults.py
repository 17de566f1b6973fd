"""`raylift plan` simulates goodput at the failure rates the past runs under storage.path
moved (issue 49): the same journals a run's driver reads (trainer.checkpoint.past_runs,
pyarrow) read on the laptop with the standard library or boto3 (fault_history), pooled
the same way; one line says which rates, from what. Storage that cannot be read: one
line, the plan from the prior."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.support.jobs import llama7b_job
from tests.support.past_runs import write_past_runs
from trainer.checkpoint import past_runs
from trainer.planner import cadence as cad
from trainer.planner import fault_history
from trainer.storage.location import resolve


def _expected(nodes: int) -> cad.Rates:
    """By hand: the 10-15 % band's prior for `nodes` g5.12xlarge (4 GPUs), weighted 24 h,
    with the 2 RAM-tier and 1 storage faults of 16 node-hours (16 / nodes hours of it)."""
    prior = cad.prior_rates(nodes, 4, "10-15%")
    hours = 24 + 16 / nodes
    return cad.Rates((prior.memory * 24 + 2) / hours, (prior.storage * 24 + 1) / hours)


def test_plan_prints_the_rates_the_past_runs_moved(tmp_path, capsys) -> None:
    from tools import plan as plan_cli

    job = llama7b_job(
        tmp_path, strategy={"name": "fsdp"}, scaling={"num_workers": 8, "use_gpu": True}
    )
    write_past_runs(resolve(str(tmp_path / "runs")))  # the job's storage.path
    assert plan_cli.main([str(job), "--instance", "g5.12xlarge", "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["goodput"]
    (line,) = [x for x in lines if x.startswith("failure rates")]
    assert line.startswith("failure rates (2 × g5.12xlarge spot)"), line
    want = _expected(2)
    assert f"{want.memory:.3g}/h the RAM tier covers, {want.storage:.3g}/h only storage" in line
    assert "2 past run(s) on that pool" in line and "16.0 node-hours" in line
    assert "2 unreadable run(s) skipped" in line
    # a drill's stated rate: the past is not counted, and the line says so
    stated = ["--set", "checkpoint.failure_rate_per_hour=6"]
    assert plan_cli.main([str(job), "--instance", "g5.12xlarge", "--json", *stated]) == 0
    lines = json.loads(capsys.readouterr().out)["goodput"]
    assert any(x.endswith("(6/h) as stated; past runs not counted") for x in lines), lines
    # and the goodput above it is simulated at those rates
    from trainer.config import load_config
    from trainer.planner.faults_sim import scenario_for_plan
    from trainer.planner.plan import plan_job

    cfg = load_config(job)
    past = fault_history.read_storage(cfg.storage.path)
    s = scenario_for_plan(cfg, plan_job(cfg, "g5.12xlarge"), 1.0, past=past)
    assert s is not None and s.rates_from == line
    assert (s.rates.memory, s.rates.storage) == pytest.approx((want.memory, want.storage))


def test_plan_reads_the_past_runs_under_s3(s3_server) -> None:
    """The same evidence through boto3 (the laptop) as through pyarrow (the driver);
    unreachable storage is one line and the prior."""
    uri = f"s3://{s3_server['bucket']}/past-{uuid.uuid4().hex[:8]}/runs"
    root = resolve(uri, s3_server["endpoint"])
    write_past_runs(root)
    laptop = fault_history.read_storage(uri, s3_server["endpoint"])
    driver = past_runs.read_location(root, exclude=None)
    assert laptop.to_dict() == driver.to_dict()
    spot = laptop.for_pool("g5.12xlarge", "spot")
    assert (spot.runs, spot.node_hours, spot.tiers()) == (2, 16.0, {"memory": 2, "storage": 1})
    assert sorted(laptop.skipped) == ["broken", "garbled"]
    prior = cad.prior_rates(8, 4, "10-15%")
    rates, _ = fault_history.plan_rates(prior, laptop, "g5.12xlarge", "spot", 8, "10-15%")
    assert rates.memory == pytest.approx(_expected(8).memory)

    began = time.monotonic()
    gone = fault_history.read_storage(uri, "http://127.0.0.1:9")  # nothing listens there
    assert time.monotonic() - began < 10
    assert gone.pools == {} and gone.note is not None and "past runs not read" in gone.note
    rates, line = fault_history.plan_rates(prior, gone, "g5.12xlarge", "spot", 8, "10-15%")
    assert rates == prior
    assert "\n" not in line and "alone" in line and "past runs not read" in line
