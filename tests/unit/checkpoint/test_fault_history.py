"""The cadence's failure rates learn from the cluster's past runs (issue 49): the journals
of the other runs under storage.path, on the same pool, pooled per node with the run's
own (trainer.planner.fault_history), read once by the driver (past_runs) and handed to
every rank (cadence_setup.for_job). Real journal files, written by the real Journal."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.past_runs import SPOT, H, T, attempt, write_past_runs
from trainer.checkpoint import past_runs
from trainer.planner import cadence as cad
from trainer.planner import fault_history
from trainer.resilience import cadence_setup
from trainer.resilience import journal as journal_mod
from trainer.resilience.journal import Journal
from trainer.storage.location import resolve


def _journal(root: Path, run: str, source: str) -> Journal:
    return Journal(resolve(str(root / run)), source)


def _own_run(root: Path) -> Path:
    """The new run's own folder: its first attempt on the same pool lost a worker after
    half an hour (its own journal counts through cadence.journal_faults)."""
    j = _journal(root, "own", "attempt-1-rank0")
    attempt(j, T + 5 * H, 1, fault_history.pool_record(SPOT, 8))
    _journal(root, "own", "controller-1").add("failure", time=T + 5.5 * H, cause="worker_died")
    return root / "own"


def _cfg(**checkpoint: object) -> SimpleNamespace:
    ck = {"every_steps": "auto", "memory_every": "auto", "max_overhead": 0.02}
    ck |= {"max_interval_s": None, "failure_rate_per_hour": None, **checkpoint}
    return SimpleNamespace(
        train=SimpleNamespace(as_test=False),
        strategy=SimpleNamespace(name="fsdp"),
        checkpoint=SimpleNamespace(**ck),
    )


def test_a_new_run_starts_from_the_pooled_rates_of_its_pool(tmp_path) -> None:
    write_past_runs(resolve(str(tmp_path)))
    own = _own_run(tmp_path)
    reading = past_runs.read_location(resolve(str(tmp_path)), exclude="own")
    assert sorted(reading.skipped) == ["broken", "garbled"]  # skipped, never an error
    assert reading.read == 5  # past-a, past-b, other-pool, drill, old: not the run itself
    spot = reading.for_pool("g5.12xlarge", "spot")
    assert spot.runs == 2
    assert spot.node_hours == pytest.approx(6.0 + 10.0)
    assert spot.faults == {"worker_died": 1, "node_lost": 1, "driver_lost": 1, "preempted": 1}
    assert reading.for_pool("g5.12xlarge", "on-demand").faults == {"worker_died": 3}

    # What every rank gets from the driver (through Ray's config: JSON), on rank 0 with
    # its journal: the rates its cadence starts from.
    prepared = json.loads(json.dumps(reading.to_dict()))
    rt = SimpleNamespace(run=resolve(str(own)), world_size=8, node_labels=SPOT, journal=None)
    cadence = cadence_setup.for_job(_cfg(), rt, prepared)
    assert cadence is not None
    # By hand: the prior of 2 nodes × 4 GPUs on the 10-15 % band, weighted 24 h; the run's
    # own kill in its 0.5 h; the past runs' 2 RAM-tier faults (worker died, node lost) and
    # 1 storage fault (the driver) over 16 node-hours = 8 hours of this 2-node job. The
    # other pool, the drill, the older run and the unreadable one add nothing.
    prior = cad.prior_rates(2, 4, "10-15%")
    assert cadence.rates.memory == pytest.approx((prior.memory * 24 + 1 + 2) / (24 + 0.5 + 8))
    assert cadence.rates.storage == pytest.approx((prior.storage * 24 + 0 + 1) / (24 + 0.5 + 8))
    assert cadence.rates.memory > 10 * prior.memory  # the past moved it, and by much
    # A drill states its rate: the past does not move it.
    drill = cadence_setup.for_job(_cfg(failure_rate_per_hour=6.0), rt, prepared)
    assert drill is not None
    stated = cad.prior_rates(2, 4, "10-15%", hard_per_hour=6.0)
    assert drill.rates.memory == pytest.approx((stated.memory * 24 + 1) / (24 + 0.5))

    # The first decision journals what moved the rates; a later one does not repeat it.
    rt.journal = Journal(resolve(str(own)), "attempt-2-rank0")
    cadence = cadence_setup.for_job(_cfg(), rt, prepared)
    assert cadence is not None
    for _ in range(cad.Cadence.WARMUP_STEPS):
        cadence.step_time(1.0)
    cadence.saved(cad.RAM, 0.01)
    cadence.saved(cad.STORAGE, 0.01)
    cadence.decide_alone()
    cadence.shorten("rebalance")
    cadence.decide_alone()
    decisions = [r for r in journal_mod.read(rt.run) if r["event"] == "cadence"]
    assert len(decisions) == 2
    assert decisions[0]["rates_from"] == {
        "pool": "g5.12xlarge/spot",
        "past_runs": 2,
        "past_node_hours": 16.0,
        "past_job_hours": 8.0,
        "past_faults": {"memory": 2, "storage": 1},
        "past_skipped": 2,
    }
    assert "rates_from" not in decisions[1]


def test_the_newest_runs_within_the_budget(tmp_path) -> None:
    write_past_runs(resolve(str(tmp_path)))
    runs = ["past-b", "past-a", "other-pool", "drill", "old", "broken", "garbled"]
    for age, run in enumerate(runs):
        for f in (tmp_path / run / "journal").iterdir():
            os.utime(f, (T - age * H, T - age * H))
    store = fault_history._LocalStore(str(tmp_path))  # the laptop's reader, the same layout
    newest = fault_history.collect(store, exclude=None, max_runs=1)
    assert (newest.read, list(newest.pools)) == (1, ["g5.12xlarge/spot"])
    assert newest.pools["g5.12xlarge/spot"].node_hours == pytest.approx(10.0)  # past-b only
    ticks = iter(range(100))
    spent = fault_history.collect(store, exclude=None, budget_s=2.5, clock=lambda: next(ticks))
    assert spent.note is not None and "time budget" in spent.note
    assert spent.read < 6
    # storage that cannot be listed: a note, no evidence, no error
    (tmp_path / "file").write_text("x")
    nothing = past_runs.read_location(resolve(str(tmp_path / "file")), exclude=None)
    assert nothing.pools == {} and nothing.note is not None


def test_a_run_journals_its_pool_and_what_moved_its_rates(job, tmp_path, monkeypatch) -> None:
    """The whole path in this process (one torchrun-style rank, no Ray): the driver's
    prepare_inputs reads the past run under storage.path, the worker's cadence starts from
    the pooled rates and journals why, and the attempt journals its pool for later runs."""
    from trainer.config import load_config
    from trainer.loop import train
    from trainer.runtime import launch
    from trainer.runtime.worker import TorchrunRuntime

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    here = fault_history.pool_record({}, 1)  # a machine with no pool labels: 1 node
    earlier = resolve(str(tmp_path / "runs" / "earlier"))  # the job's storage.path
    attempt(Journal(earlier, "attempt-1-rank0"), T, 1, here)
    Journal(earlier, "controller-1").add("failure", time=T + 2 * H, cause="worker_died")
    path = job(
        "now",
        train={"max_steps": 8, "log_every": 4, "eval_every": 100},
        checkpoint={"every_steps": "auto", "memory_every": "auto", "export_every": 100},
        scaling={"num_workers": 1},
    )
    cfg = load_config(path, [])
    prep = launch.prepare_inputs(cfg, progress=False)
    assert prep.past_faults["pools"]["unknown/on-demand"]["node_hours"] == pytest.approx(2.0)
    train(cfg, prep, TorchrunRuntime(cfg, "gloo"))
    records = journal_mod.read(resolve(str(tmp_path / "runs" / "now")))
    (start,) = [r for r in records if r["event"] == "attempt"]
    assert (
        start["pool"]
        == here
        == {
            "instance_type": "",
            "market": "on-demand",
            "nodes": 1,
            "gpus_per_node": 1,
        }
    )
    first = next(r for r in records if r["event"] == "cadence")
    assert first["rates_from"]["past_runs"] == 1
    assert first["rates_from"]["past_faults"] == {"memory": 1, "storage": 0}
    # no RAM tier under torchrun: storage covers both tiers' failures
    prior = cad.prior_rates(1, 1, None)
    want = (prior.memory * 24 + 1) / (24 + 2) + prior.storage * 24 / (24 + 2)
    assert first["rates_per_hour"]["storage"] == pytest.approx(want, abs=1e-8)
