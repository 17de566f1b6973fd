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


LLAMA7B_JOB = {
    "model": {"path": "s3://models/llama-2-7b"},
    "data": {"train_file": "/d.jsonl", "block_size": 1024},
    "strategy": {"name": "deepspeed", "config": "zero3_offload"},
    "train": {"micro_batch_size": 8, "max_steps": 100},
    "scaling": {"num_workers": 2, "use_gpu": True},
    "run": {"name": "c"},
}


def test_the_planner_estimate_stands_beside_the_cost() -> None:
    from tools.jobcli.cost import planner_lines
    from trainer.config import JobConfig
    from trainer.planner.plan import plan_job

    job = {"config": LLAMA7B_JOB, "params": 6_738_415_616}
    steps = [{"step": 1, "tokens_seen": 16_384}, {"step": 100, "tokens_seen": 1_638_400}]
    (line,) = planner_lines(job, NODES, steps)
    # Planned again on the types the run used: g5.4xlarge workers, rank 0 on g5.8xlarge.
    lay = plan_job(
        JobConfig.model_validate(LLAMA7B_JOB), "g5.4xlarge",
        rank0_instance="g5.8xlarge", params=job["params"],
    ).layout  # fmt: skip
    e = lay.epoch(1_638_400)
    assert line.startswith(f"cost: the planner estimated {e['hours']:.2f} h, ${e['usd_spot']:,.2f}")
    assert "for these 1,638,400 tokens on 2 workers on 1× g5.8xlarge (rank 0)" in line
    # No job record (a run from before), no typed nodes or no tokens: nothing is estimated.
    assert planner_lines(None, NODES, steps) == []
    assert planner_lines(job, [{**n, "instance_type": None} for n in NODES], steps) == []
    assert planner_lines(job, NODES, [{"step": 1}]) == []


def test_the_driver_records_the_job_and_report_plans_it_again(tmp_path) -> None:
    from trainer.config import JobConfig
    from trainer.runtime.launch import _record_job
    from trainer.storage.location import resolve

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            }
        )
    )  # fmt: skip
    cfg = JobConfig.model_validate({**LLAMA7B_JOB, "model": {"path": str(model)}})
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    _record_job(cfg, resolve(str(run)))
    record = json.loads((run / "job.json").read_text())
    assert record["config"]["model"]["path"] == str(model)
    assert 6.6e9 < record["params"] < 6.8e9  # Llama-2-7B's shape
    (run / "nodes" / "driver-1.json").write_text(
        json.dumps({"nodes": {f"n{i}": n for i, n in enumerate(NODES)}})
    )
    steps = [
        {"step": s, "time": 10.0 * s, "loss": 1.0, "tokens_per_s": 5.0, "tokens_seen": 8192 * s}
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    lines = summary_lines(load_run(str(run)))
    assert any(x.startswith("cost: the planner estimated ") for x in lines), lines
