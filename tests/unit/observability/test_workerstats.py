"""Per-worker memory and step phases, gathered over a real 2-process gloo group on CPU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.observability.workerstats import FIELDS, PHASES, StepTimer, WorkerStats, summarize

EXTRA_GIB = 0.5


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=None
    )
    stats = WorkerStats(torch.device("cpu"), rank, 2, per_rank_every=2)
    stats.gather()  # the window before: the peaks start from here
    with stats.phase("fwd_bwd"):
        if rank == 1:
            # A known extra allocation, touched so it is resident, then freed: only the
            # peak can show it.
            extra = torch.ones(int(EXTRA_GIB * 2**30 / 4), dtype=torch.float32)
            extra += 1
            del extra
    with stats.phase("optim"):
        time.sleep(0.05 if rank == 0 else 0.0)  # a phase long enough to see on rank 0
    stats.step_done()
    got = stats.gather()
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_extra_tensor_on_one_rank_shows_as_the_max_by_that_much(tmp_path):
    out = tmp_path / "stats.json"
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    got = json.loads(out.read_text())
    assert got["mem_peak_gib_max_rank"] == 1
    extra = got["mem_peak_gib_max"] - got["mem_peak_gib_min"]
    assert extra == pytest.approx(EXTRA_GIB, abs=0.15), got
    per_rank = got["per_rank"]  # the 2nd record, per_rank_every=2
    assert per_rank["mem_peak_gib"][1] - per_rank["mem_peak_gib"][0] == pytest.approx(
        EXTRA_GIB, abs=0.15
    )
    # Host RSS now (after the free) is not the peak.
    assert got["host_rss_gib_max"] < got["mem_peak_gib_max"] - 0.3
    assert got["t_optim_s_max_rank"] == 0 and got["t_optim_s_max"] >= 0.05
    assert got["mem_capacity_gib"] > 1 and 0 < got["mem_peak_pct_max"] < 100
    assert set(per_rank) == set(FIELDS)


def test_timer_means_per_step_and_resets():
    t = StepTimer()
    for _ in range(4):
        t.add("data", 0.5)
        t.add("optim", 1.0)
        t.steps += 1
    got = t.take()
    assert got["t_data_s"] == 0.5 and got["t_optim_s"] == 1.0 and got["t_eval_s"] == 0.0
    assert set(got) == {f"t_{p}_s" for p in PHASES}
    assert t.take()["t_data_s"] == 0.0


def test_summary_names_the_rank_with_the_max():
    rows = [[float(i == 2) * 3.0 + j for j in range(len(FIELDS))] for i in range(4)]
    s = summarize(rows)
    assert s["mem_peak_gib_max_rank"] == 2 and s["mem_peak_gib_max"] == 3.0
    assert s["mem_peak_gib_min"] == 0.0 and s["mem_peak_gib_mean"] == 0.75


def test_single_process_gather_without_a_group():
    stats = WorkerStats(torch.device("cpu"), 0, 1, per_rank_every=5)
    first = stats.gather()
    assert "per_rank" in first and first["mem_peak_gib_max_rank"] == 0
    assert "per_rank" not in stats.gather()
