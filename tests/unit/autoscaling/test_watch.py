"""The driver's wait report (trainer.autoscaling.watch) and how the CLI draws it
(tools.jobcli.waiting): nodes needed per worker shape against nodes up, and which pool the
autoscaler is launching and why, from Ray's own ClusterStatus objects."""

from __future__ import annotations

import io

from ray.autoscaler.v2.schema import ClusterStatus, LaunchRequest, NodeInfo
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from tools.jobcli import waiting
from trainer.autoscaling.watch import WAIT_MARK, demand, snapshot, worker_group_started

GPU = {"CPU": 1, "GPU": 1}
RANK0 = [{"large_cpu_mem": "true"}] + [{}] * 4


def _node(gpus: int, labels: dict[str, str] | None = None, alive: bool = True) -> dict:
    return {
        "Alive": alive,
        "Resources": {"CPU": 8.0, "GPU": float(gpus), "memory": 1e10},
        "Labels": labels or {},
    }


HEAD = {"Alive": True, "Resources": {"CPU": 4.0, "node:__internal_head__": 1.0}, "Labels": {}}


def test_demand_counts_rank0s_labelled_shape_apart() -> None:
    need = demand(5, GPU, RANK0)
    assert {s.describe(): n for s, n in need.items()} == {
        "CPU 1, GPU 1 on large_cpu_mem=true": 1,
        "CPU 1, GPU 1": 4,
    }


def test_nodes_up_are_counted_per_shape_labelled_first_dead_nodes_not() -> None:
    need = demand(5, GPU, RANK0)
    nodes = [
        HEAD,
        _node(1, {"large_cpu_mem": "true"}),
        _node(1),
        _node(2),  # two GPUs: room for two workers
        _node(1, alive=False),
    ]
    rec = snapshot(need, nodes, started=False, now=0)
    assert rec["shapes"] == [
        {"shape": "CPU 1, GPU 1 on large_cpu_mem=true", "need": 1, "up": 1},
        {"shape": "CPU 1, GPU 1", "need": 4, "up": 3},
    ]
    # The labelled node holds rank 0 and nothing more: a plain shape never takes its room.
    plain_first = dict(reversed(need.items()))
    only_labelled = snapshot(plain_first, [HEAD, _node(1, {"large_cpu_mem": "true"})], False, 0)
    assert [s["up"] for s in only_labelled["shapes"]] == [1, 0]


def test_the_worker_groups_placement_group_says_when_it_started() -> None:
    def pg(state: str, n: int, res: dict) -> dict:
        return {"state": state, "bundles": {i: dict(res) for i in range(n)}}

    assert worker_group_started({}, (5, 5), GPU) is None
    assert worker_group_started({"a": pg("PENDING", 5, GPU)}, (5, 5), GPU) is False
    assert worker_group_started({"a": pg("CREATED", 5, GPU)}, (5, 5), GPU) is True
    # Another job's group of another shape or size is not ours.
    assert worker_group_started({"a": pg("CREATED", 5, {"CPU": 1})}, (5, 5), GPU) is None
    assert worker_group_started({"a": pg("CREATED", 3, GPU)}, (5, 5), GPU) is None
    # Elastic: any size in [min, max].
    assert worker_group_started({"a": pg("CREATED", 3, GPU)}, (2, 5), GPU) is True


def _status() -> ClusterStatus:
    """What Ray's get_cluster_status returns after spot failed: on demand launching."""
    return ClusterStatus(
        pending_launches=[
            LaunchRequest("", "gpu-ondemand", 2, LaunchRequest.Status.PENDING, request_ts_s=70)
        ],
        failed_launches=[
            LaunchRequest(
                "",
                "gpu-spot",
                2,
                LaunchRequest.Status.FAILED,
                request_ts_s=10,
                failed_ts_s=55,
                details="Instance allocation timeout\nmore",
            )
        ],
        pending_nodes=[
            NodeInfo("g5.8xlarge", "large-cpu-mem", "i-0abc", "", details="RAY_INSTALLING")
        ],
    )


def test_which_pool_it_waits_on_and_why() -> None:
    need = demand(3, GPU, RANK0[:3])
    rec = snapshot(need, [HEAD], started=False, status=_status(), now=100)
    assert rec["pending"] == [
        {"pool": "gpu-ondemand", "count": 2, "since_s": 30},
        {"pool": "large-cpu-mem", "count": 1, "status": "RAY_INSTALLING"},
    ]
    assert rec["failed"] == [
        {"pool": "gpu-spot", "count": 2, "ago_s": 45, "why": "Instance allocation timeout"}
    ]
    rec["waited_s"] = 95
    assert waiting.lines(rec) == [
        "waiting 1m35s for the worker group: 0/3 workers' nodes up",
        "  0/1 up: CPU 1, GPU 1 on large_cpu_mem=true",
        "  0/2 up: CPU 1, GPU 1",
        "  launching 2 × gpu-ondemand (asked 0m30s ago)",
        "  launching 1 × large-cpu-mem (RAY_INSTALLING)",
        "  waiting on pool gpu-ondemand, large-cpu-mem; gpu-spot could not launch "
        "(Instance allocation timeout)",
    ]


def test_the_follower_draws_bars_until_the_group_starts() -> None:
    import json

    out = io.StringIO()
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(file=out, width=120, force_terminal=False),
    )
    bars = waiting.WaitBars(bar)
    need = demand(3, GPU, RANK0[:3])
    rec = snapshot(need, [HEAD, _node(1)], False, _status(), now=100)
    line = "some prefix " + WAIT_MARK + json.dumps(rec)
    with bar:
        bars.update(waiting.parse(line))
        assert [(t.description, t.completed, t.total) for t in bar.tasks] == [
            ("nodes for CPU 1, GPU 1 on large_cpu_mem=true", 0, 1),
            ("nodes for CPU 1, GPU 1", 1, 2),
        ]
        bars.update(waiting.parse(line))  # the same news is not printed twice
        bars.update({**rec, "started": True, "waited_s": 130})
        assert bar.tasks == []
    text = out.getvalue()
    assert text.count("gpu-spot could not launch") == 1, text
    assert "worker group started after 2m10s waiting for nodes" in text
