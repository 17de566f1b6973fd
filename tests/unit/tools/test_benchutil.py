"""The benchmark harness itself: interleaving, median/spread, verdicts, and that a missed
target fails only after the JSON and the plot are written. No training: fast."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.bench.benchutil import (
    Check,
    CpuWatch,
    Stats,
    TargetMissed,
    interleave,
    optional_env_int,
    repeats,
    results_dir,
    run_benchmark,
    size,
    torch_or_ray_worker,
)


def _recorder(calls: list[str], name: str, value: float = 1.0):
    def command(i: int) -> dict[str, float]:
        calls.append(f"{name}{i}")
        return {"v": value}

    return command


def test_interleave_runs_round_by_round():
    calls: list[str] = []
    commands = {n: _recorder(calls, n) for n in ("a", "b", "c")}
    rounds = interleave(commands, 3, log=lambda _: None)
    assert calls == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    assert len(rounds) == 3
    assert list(rounds[1]) == ["a", "b", "c"]


def test_interleave_can_rotate_who_runs_first():
    calls: list[str] = []
    commands = {n: _recorder(calls, n, v) for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    rounds = interleave(commands, 4, log=lambda _: None, rotate=True)
    assert calls == ["a0", "b0", "c0", "b1", "c1", "a1", "c2", "a2", "b2", "a3", "b3", "c3"]
    assert all(list(r) == ["a", "b", "c"] and r["c"]["v"] == 3.0 for r in rounds)


def test_stats_median_and_spread():
    s = Stats((3.0, 1.0, 2.0))
    assert (s.median, s.low, s.high, s.spread) == (2.0, 1.0, 3.0, 2.0)
    assert s.relative_spread == pytest.approx(1.0)
    assert Stats((1.0, 2.0, 3.0, 10.0)).median == 2.5
    assert Stats((5.0, 5.0, 5.0)).spread == 0.0


@pytest.mark.parametrize(
    ("higher", "value", "expected"),
    [
        (True, 0.95, True),  # the target itself passes
        (True, 0.9499, False),
        (True, 2.0, True),
        (False, 1.25, True),
        (False, 1.2501, False),
        (False, 0.5, True),
        (True, math.nan, False),
        (False, math.nan, False),
    ],
)
def test_verdict(higher, value, expected):
    target = 0.95 if higher else 1.25
    assert Check("x", lambda r: 0.0, target, higher_is_better=higher).passes(value) is expected


def test_check_without_target_is_not_judged():
    assert Check("x", lambda r: 0.0).passes(0.0) is None


@pytest.fixture(autouse=True)
def _not_smoke(monkeypatch):
    """`make test` runs with RAYLIFT_BENCH_SMOKE=1; these tests set the mode they test."""
    monkeypatch.delenv("RAYLIFT_BENCH_SMOKE", raising=False)


def test_repeats_from_env(monkeypatch):
    monkeypatch.delenv("RAYLIFT_BENCH_REPEATS", raising=False)
    assert repeats() == 3
    monkeypatch.setenv("RAYLIFT_BENCH_REPEATS", "5")
    assert repeats() == 5
    for bad in ("2", "x"):
        monkeypatch.setenv("RAYLIFT_BENCH_REPEATS", bad)
        with pytest.raises(ValueError, match="RAYLIFT_BENCH_REPEATS"):
            repeats()


def test_optional_setting_is_none_unset_and_checked_when_set(monkeypatch):
    name = "RAYLIFT_BENCH_TOY_NICE"
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, unset)
        assert optional_env_int(name, minimum=0) is None
    monkeypatch.setenv(name, "0")
    assert optional_env_int(name, minimum=0) == 0
    for bad in ("-1", "ten"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            optional_env_int(name, minimum=0)


def _ratio_bench(tmp_path, a_values, target):
    """A over B per round; A's value changes each round, B is constant."""
    it = iter(a_values)
    return run_benchmark(
        "toy",
        title="toy",
        commands={"a": lambda i: {"v": next(it)}, "b": lambda i: {"v": 2.0}},
        checks=[Check("ratio", lambda r: r["a"]["v"] / r["b"]["v"], target)],
        metric="v",
        rounds=len(a_values),
        out_dir=tmp_path,
    )


def test_pass_writes_json_and_plot(tmp_path, capsys):
    result = _ratio_bench(tmp_path, [2.0, 1.8, 2.2], target=0.95)
    assert result["passed"] is True
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["order"] == ["a#0", "b#0", "a#1", "b#1", "a#2", "b#2"]
    check = saved["checks"][0]
    assert check["verdict"] == "PASS"
    assert check["median"] == pytest.approx(1.0)
    assert check["spread"] == pytest.approx(0.2)
    assert check["values"] == pytest.approx([1.0, 0.9, 1.1])
    assert saved["commands"]["a"]["v"]["median"] == pytest.approx(2.0)
    assert (tmp_path / "toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "toy ratio: 1 (median of 3" in out
    assert "target ≥ 0.95  PASS" in out


def test_miss_raises_after_writing(tmp_path, capsys):
    # The median (0.9) misses; one lucky round (1.1) must not rescue it.
    with pytest.raises(TargetMissed, match="missed ratio"):
        _ratio_bench(tmp_path, [1.8, 2.2, 1.6], target=0.95)
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["passed"] is False
    assert saved["missed"] == ["ratio"]
    assert saved["checks"][0]["verdict"] == "MISS"
    assert saved["checks"][0]["median"] == pytest.approx(0.9)
    assert (tmp_path / "toy.png").stat().st_size > 0
    assert "target ≥ 0.95  MISS" in capsys.readouterr().out


def test_miss_is_an_assertion_so_pytest_fails():
    assert issubclass(TargetMissed, AssertionError)


def test_smoke_run_reports_every_verdict_but_never_fails(tmp_path, monkeypatch, capsys):
    """A smoke run (make test) runs one round at the smoke size, prints the same
    PASS/MISS lines, and a MISS does not raise: its sizes say nothing about the target."""
    monkeypatch.setenv("RAYLIFT_BENCH_SMOKE", "1")
    assert repeats() == 1
    assert size("RAYLIFT_BENCH_X", 200, 4) == 4
    monkeypatch.setenv("RAYLIFT_BENCH_X", "7")
    assert size("RAYLIFT_BENCH_X", 200, 4) == 7
    result = _ratio_bench(tmp_path, [1.6], target=0.95)
    assert result["passed"] is False and result["smoke"] is True
    assert "target ≥ 0.95  MISS  (smoke size: not judged)" in capsys.readouterr().out
    monkeypatch.delenv("RAYLIFT_BENCH_SMOKE")
    monkeypatch.delenv("RAYLIFT_BENCH_X")
    assert size("RAYLIFT_BENCH_X", 200, 4) == 200
    assert results_dir().name == "bench"


def test_training_processes_are_ray_train_workers_and_torchruns_children():
    cmdlines = {
        10: ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer"],
        11: ["/venv/bin/python", "-u", "-m", "trainer", "run", "job.yaml"],
        20: ["ray::RayTrainWorker.run_train_fn"],
        21: ["ray::TrainController.run"],
        22: ["ray::IDLE"],
        30: ["python", "-m", "trainer", "run", "job.yaml"],  # a Ray job's driver
    }
    parents = {10: 1, 11: 10, 20: 5, 21: 5, 22: 5, 30: 5}
    found = {pid for pid in cmdlines if torch_or_ray_worker(cmdlines, pid, parents[pid])}
    assert found == {11, 20}


def _spin(tag: str) -> subprocess.Popen:
    """A process that keeps one core busy for up to 60 s and prints a line each time it
    has used another CPU-second; `tag` is in its command line."""
    code = (
        "import time\n"
        "t, n = time.time(), 1\n"
        "while time.time() - t < 60:\n"
        "    if time.process_time() >= n:\n"
        "        print(n, flush=True)\n"
        "        n += 1\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, tag], stdout=subprocess.PIPE, text=True)


def test_cpu_watch_splits_the_machines_cpu_into_training_and_the_rest():
    def is_training(cmdlines, pid, ppid):
        return "cpuwatch-train" in (cmdlines.get(pid) or ())

    procs = [_spin("cpuwatch-train"), _spin("cpuwatch-other")]
    try:
        with CpuWatch(is_training, interval=0.1) as cpu:
            # The window starts once the training spinner has used one CPU-second (its CPU
            # before the window is not the window's) and ends when it has used another.
            assert procs[0].stdout.readline().strip() == "1"
            t0 = time.time()
            assert procs[0].stdout.readline().strip() == "2"
            t1 = time.time()
            train, other = cpu.cores(t0, t1)  # waits for the sample after t1
            assert math.isnan(cpu.cores(t0, time.time() + 60)[0])  # no sample after it yet
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    # One spinning process is at most one core; on a busy 2-core machine it gets less,
    # never nothing (at a load average of 25 here each got 0.05-0.17 of a core, so the floor
    # only tells a counted process from a missed one, which reads 0). The other spinner
    # counts as the rest of the machine.
    assert 0.02 < train <= 1.1, train
    assert other > 0.02, other
    assert train + other <= os.cpu_count() + 0.2, (train, other)  # the machine, not more
