"""The step's agreement on a GPU job (trainer.distributed.hostsync): host floats summed on a
gloo group of its own, never as a device tensor, and the per-worker stats gathered on it;
two real gloo processes on CPU (the module stays light: spawn imports it in each)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trainer.distributed.hostsync import HostReduce


def _two_ranks(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.observability.workerstats import WorkerStats

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # A device that is not the CPU: the reducer makes a gloo group of its own (on a GPU job
    # the default group is NCCL's, which cannot sum host memory).
    reduce = HostReduce(torch.device("meta"), 2)
    got = reduce([float(rank), 1.0, 0.5])
    stats = WorkerStats(torch.device("cpu"), rank, 2, group=reduce.group)
    rows = stats.gather()
    if rank == 0:
        mine = reduce.group is not None and reduce.group != dist.group.WORLD
        Path(out).write_text(
            json.dumps({"sum": got, "own": mine, "ranks": len(rows["per_rank"]["ooms"])})
        )
    dist.destroy_process_group()


def test_on_a_gpu_job_the_step_agreement_runs_on_a_gloo_group_of_its_own(tmp_path):
    out = tmp_path / "out.json"
    mp.start_processes(
        _two_ranks,
        args=(str(tmp_path / "store"), str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    got = json.loads(out.read_text())
    assert got == {"sum": [1.0, 2.0, 1.0], "own": True, "ranks": 2}
