"""Goodput (trainer.observability.goodput) on a synthetic metrics file and journal whose
split is known to the second: two workers, a worker kill after step 10, a resume from 8."""

from __future__ import annotations

import pytest

from trainer.observability import goodput

PHASES = {"t_data_s_mean": 0.1, "t_fwd_bwd_s_mean": 0.6, "t_optim_s_mean": 0.1}


def _run(cause: str = "worker_died") -> tuple[list[dict], list[dict]]:
    records: list[dict] = [{"event": "start", "attempt": 1, "from_step": 0, "world_size": 2}]
    for s in range(1, 11):  # one record a step, 1 s each: 0.8 s of step, 0.2 s of storage stall
        records.append(
            {
                "event": "train",
                "attempt": 1,
                "step": s,
                "time": 25.0 + s,
                "mfu": 0.4,
                "t_ckpt_s_mean": 0.2,
                "t_eval_s_mean": 0.0,
                **PHASES,
            }
        )
    records.append({"event": "resume", "attempt": 2, "from_step": 8})
    records.append({"event": "start", "attempt": 2, "from_step": 8, "world_size": 2})
    for s in range(9, 21):
        records.append(
            {
                "event": "train",
                "attempt": 2,
                "step": s,
                "time": 55.0 + (s - 8),
                "mfu": 0.5,
                "t_ckpt_s_mean": 0.1,
                "t_snap_s_mean": 0.1,
                **PHASES,
            }
        )
    journal = [
        {"time": 0.0, "event": "driver"},
        {"time": 25.0, "event": "attempt", "began": 10.0, "world_size": 2, "from_step": 0},
        {"time": 40.0, "event": "failure", "cause": cause},
        {
            "time": 55.0,
            "event": "attempt",
            "began": 50.0,
            "restore_s": 2.0,
            "world_size": 2,
            "from_step": 8,
            "after": "failure",
            "lost_steps": 2,
        },
        {"time": 70.0, "event": "finished"},
    ]
    return records, journal


def test_the_split_of_a_run_with_a_kill() -> None:
    records, journal = _run()
    g = goodput.measure(records, journal, usd_total=14.0)
    p = {k: v / 2 for k, v in g.parts.items()}  # per worker
    assert g.paid == pytest.approx(70.0 * 2)  # wall × workers
    assert abs(g.accounted - g.paid) <= 0.01 * g.paid
    assert p["waiting"] == pytest.approx(10 + 10)  # driver → workers; failure → new workers
    assert p["startup"] == pytest.approx(15 + 3)
    assert p["restore"] == pytest.approx(2)
    assert p["kept"] == pytest.approx(8 * 0.8 + 12 * 0.8)
    # steps 9 and 10 trained and thrown away, and the 5 s from the last step to the failure
    assert p["lost/worker kill"] == pytest.approx(2 * 0.8 + 5)
    assert p["ckpt/storage"] == pytest.approx(10 * 0.2 + 12 * 0.1)
    assert p["ckpt/memory"] == pytest.approx(12 * 0.1)
    assert p["tail"] == pytest.approx(3)
    assert g.runtime == pytest.approx(20 * 0.8 / 70)
    assert g.program == pytest.approx((8 * 0.4 + 12 * 0.5) / 20)
    assert g.usd("kept") == pytest.approx(14.0 * 20 * 0.8 / 70)
    text = goodput.lines(g)
    assert text[0].startswith("goodput: runtime 22.9%") and "MFU" in text[0]
    assert "retrained: worker kill" in text[1] and "$" in text[1]


def test_causes_and_no_prices() -> None:
    records, journal = _run("node_lost")
    g = goodput.measure(records, journal)
    assert g.parts["lost/node loss"] > 0 and g.parts["lost/worker kill"] == 0
    assert g.usd("kept") is None
    assert goodput.lines(g)[-1].startswith("goodput: no dollars")
    # a drained notice: the loop's record, no controller cause
    records, journal = _run()
    journal[2] = {"time": 34.0, "event": "preemption", "step": 10}
    assert goodput.measure(records, journal).parts["lost/drained notice"] > 0


def test_no_run_no_goodput() -> None:
    g = goodput.measure([], [])
    assert g.paid == 0 and g.runtime is None and goodput.lines(g) == []


def test_the_inflation_a_cadence_measured_is_charged_to_its_tier() -> None:
    """Attempt 2's cadence measured that each snapshot's send slowed the steps after it by
    0.3 s in all, and a storage checkpoint's upload by 0.4 s: each of its 12 records
    snapshotted, so the 11 after the first give 0.3 s of their step time to the RAM tier,
    and the step after the one storage checkpoint the journal records (step 12) 0.4 s to
    storage; nothing else moves, and the parts still add up."""
    records, journal = _run()
    plain = goodput.measure(records, journal)
    journal[3]["source"] = "attempt-2-rank0"
    journal.insert(
        4,
        {
            "time": 56.0,
            "event": "cadence",
            "source": "attempt-2-rank0",
            "costs": {"memory_inflation_s": 0.3, "storage_inflation_s": 0.4},
        },
    )
    journal.insert(
        5, {"time": 60.0, "event": "checkpoint", "step": 12, "source": "attempt-2-rank0"}
    )
    g = goodput.measure(records, journal)
    assert g.paid == pytest.approx(plain.paid)
    assert (g.parts["ckpt/memory"] - plain.parts["ckpt/memory"]) / 2 == pytest.approx(11 * 0.3)
    assert (g.parts["ckpt/storage"] - plain.parts["ckpt/storage"]) / 2 == pytest.approx(0.4)
    assert (plain.parts["kept"] - g.parts["kept"]) / 2 == pytest.approx(11 * 0.3 + 0.4)
    assert g.parts["lost/worker kill"] == pytest.approx(plain.parts["lost/worker kill"])
