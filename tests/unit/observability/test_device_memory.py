"""The device-level peak per phase (issue 47), on CPU through its stand-in, the process's
resident set: a phase that holds a large buffer records it, one that does not does not,
and the record names every phase measured."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch

from trainer.observability.device_memory import PHASES, DeviceMemory

MIB = 2**20


def test_each_phase_records_its_own_peak_on_cpu():
    dm = DeviceMemory("cpu", interval_s=0.005)
    assert not dm.cuda
    with dm.phase("load"):
        pass
    base = dm.peaks["load"]["device_peak"]
    with dm.phase("first_step"):
        big = torch.ones(256 * MIB // 4)  # 256 MiB touched
        del big
    with dm.phase("steady_step"):
        small = torch.ones(MIB // 4)
        del small
    first, steady = dm.peaks["first_step"]["device_peak"], dm.peaks["steady_step"]["device_peak"]
    assert first - base > 200 * MIB  # the freed buffer still counts: a peak, not the end
    assert steady < first - 200 * MIB  # the counter restarted at the phase's start
    rec = dm.record(rank=3)
    assert rec["rank"] == 3 and rec["dev_kind"] == "rss"
    assert rec["dev_peak_gib"] == first / 2**30
    assert {k for k in rec if k.startswith("dev_") and k.endswith("_gib")} == {
        "dev_load_gib",
        "dev_first_step_gib",
        "dev_steady_step_gib",
        "dev_peak_gib",
    }
    assert set(dm.peaks) <= set(PHASES)


def test_a_phase_keeps_its_largest_run():
    dm = DeviceMemory("cpu", interval_s=0.005)
    with dm.phase("eval"):
        big = torch.ones(128 * MIB // 4)
        del big
    once = dm.peaks["eval"]["device_peak"]
    with dm.phase("eval"):
        pass
    assert dm.peaks["eval"]["device_peak"] == once


def test_the_loops_phases_and_the_final_write(tmp_path):
    """In a process of its own: in a test process that earlier tests grew, a new 128 MiB
    tensor can land on pages already resident, and the resident set does not move (seen on
    the fresh-clone CI: the first step read exactly the load's figure for a minute)."""
    proc = multiprocessing.get_context("spawn").Process(
        target=_loops_phases_and_the_final_write, args=(str(tmp_path),)
    )
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the check's process ended with {proc.exitcode} (its stderr above)"


def _loops_phases_and_the_final_write(tmp: str) -> None:
    tmp_path = Path(tmp)
    from trainer.observability.device_memory import DevicePhases, read_final
    from trainer.storage.location import resolve

    dp = DevicePhases("cpu", interval_s=0.005)
    assert dp.phase == "load"
    dp.on_step_phase("data", steps_done=0)
    big = torch.ones(128 * MIB // 4)
    dp.on_step_phase("fwd_bwd", steps_done=0)  # not a phase change
    # On a loaded machine the sampler thread may not run while the tensor lives; values()
    # samples at once, into the phase the loop is in, so the first step sees the 128 MiB.
    dp.values()
    del big
    dp.on_step_phase("data", steps_done=1)
    dp.on_step_phase("eval", steps_done=1)
    dp.publishing(save=True, export=False)
    assert dp.phase == "checkpoint"
    dp.publishing(save=True, export=True)
    assert dp.phase == "export"
    values = dp.values()
    assert values["dev_first_step_gib"] >= values["dev_load_gib"] + 100 / 1024
    assert all(values[f"dev_{p}_gib"] > 0 for p in ("steady_step", "eval", "checkpoint"))
    run = resolve(str(tmp_path / "run"))
    dp.write_final(run, 1)
    rows = read_final(run)
    assert [r["rank"] for r in rows] == [1] and rows[0]["kind"] == "rss"
    assert rows[0]["dev_first_step_gib"] == values["dev_first_step_gib"]
    assert read_final(resolve(str(tmp_path / "nothing"))) == []
