"""A run's cost from the nodes its driver recorded (tools.jobcli.cost), priced from the
instance catalog, with what its faults wasted; read back from a run folder by
`raylift report`."""

from __future__ import annotations

import json

import pytest

from tools.jobcli.cost import cost_lines, price_nodes
from tools.report import load_run, summary_lines
from trainer.planner.catalog import get_instance

H = 3600.0


def _node(pool, market, itype, first, last):
    return {"pool": pool, "market": market, "instance_type": itype, "first": first, "last": last}


NODES = [
    _node("large-cpu-mem", "on-demand", "g5.8xlarge", 0, 2 * H),
    _node("gpu-spot", "spot", "g5.4xlarge", 0, 2 * H),
    _node("gpu-spot", "spot", "g5.2xlarge", 0, H),  # reclaimed after an hour
]


def test_dollars_per_pool_from_the_catalog_spot_at_its_spot_price() -> None:
    pools, notes = price_nodes(NODES)
    assert notes == []
    assert pools["large-cpu-mem"].hours == pytest.approx(2)
    assert pools["large-cpu-mem"].usd == pytest.approx(
        2 * get_instance("g5.8xlarge").on_demand_usd_per_hour
    )
    assert pools["gpu-spot"].nodes == 2 and pools["gpu-spot"].hours == pytest.approx(3)
    assert pools["gpu-spot"].usd == pytest.approx(
        2 * get_instance("g5.4xlarge").spot_usd_per_hour
        + get_instance("g5.2xlarge").spot_usd_per_hour
    )


def test_lines_total_and_what_faults_wasted() -> None:
    steps = [{"step": s, "time": 10.0 * s} for s in range(1, 101)]  # 10 s a step
    lines = cost_lines(NODES, steps, lost_steps=36)
    pools, _ = price_nodes(NODES)
    total = sum(p.usd for p in pools.values())
    assert lines[0].startswith("cost: gpu-spot (spot; g5.2xlarge, g5.4xlarge): 2 nodes, 3.00")
    assert f"cost: ${total:,.2f} for 5.00 instance-hours over 2.00 h" in lines[2]
    # 36 steps × 10 s = 6 min of a cluster costing total/2 h an hour.
    assert lines[3] == (
        f"cost: faults wasted 36 steps × 10.0 s = 6.0 min of the whole cluster, "
        f"about ${0.1 * total / 2:,.2f}"
    )


def test_what_cannot_be_priced_is_said_not_invented() -> None:
    local = [
        {"pool": None, "market": None, "instance_type": None, "first": 0, "last": H},
        {"pool": "cpu", "market": None, "instance_type": None, "first": 0, "last": H / 2},
    ]
    assert cost_lines(local, [], 0) == [
        "cost: this cluster's nodes carry no instance type (a local cluster): nothing to "
        "price; instance-hours by pool: cpu 0.50, no pool 1.00"
    ]
    untyped = [_node("gpu-spot", "spot", None, 0, H), _node("head", "on-demand", "m5.xlarge", 0, 1)]
    lines = cost_lines(untyped, [], 0)
    assert "1.00 instance-hours, not priced" in lines[0]
    assert lines[2].startswith("cost: at least $0.00")
    assert lines[-1] == "cost: pool gpu-spot: instance type not recorded has no catalog price; "\
        "not priced"  # fmt: skip
    assert cost_lines([], [], 0)[0].startswith("cost: no nodes recorded")


def test_report_reads_the_runs_nodes(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "nodes" / "driver-1.json").write_text(
        json.dumps({"nodes": {f"n{i}": n for i, n in enumerate(NODES)}})
    )
    steps = [{"step": s, "time": 10.0 * s, "loss": 1.0, "tokens_per_s": 5.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    lines = summary_lines(load_run(str(run)))
    assert any(x.startswith("cost: large-cpu-mem (on-demand; g5.8xlarge): 1 nodes") for x in lines)
