"""The harness every benchmark uses.

`make bench` runs every benchmark at full size and exits non-zero on a missed target.
`make test` runs them too, in smoke mode (RAYLIFT_BENCH_SMOKE=1): tiny sizes, one round,
every figure computed and its PASS/MISS line printed, but a MISS does not fail, since a
smoke-size figure says nothing about the target. What smoke mode catches is a benchmark
that no longer runs: a refactor that breaks one fails CI, not the next person to measure.
A benchmark that takes minutes even at smoke size is marked `bench_only` and left to
`make bench` (docs/development.md names them).

A benchmark names its commands (callables that make one measurement and return its
figures) and its checks (a figure computed from one round of those, and its target).
The harness then:

- runs the commands interleaved, round by round (A, B, A, B, A, B), so a slow spell on a
  shared machine lands on every command instead of on whichever happened to run during it;
- computes each check per round (A and B of the same round are paired), and reports the
  median and the spread (max - min) over the rounds;
- writes build/bench/<name>.json and build/bench/<name>.png;
- prints one line per check: figure, target, PASS or MISS;
- and only then raises `TargetMissed` if any check missed, so `make bench` exits non-zero
  with the evidence already on disk.

A new benchmark is a few lines:

    run_benchmark(
        "recovery",
        title="Time to resume after a worker is killed",
        commands={"raylift": lambda i: {"seconds": kill_and_time(i)}},
        checks=[Check("recovery_s", lambda r: r["raylift"]["seconds"], 60, higher_is_better=False)],
        metric="seconds",
    )
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "bench"
REPEATS_ENV = "RAYLIFT_BENCH_REPEATS"
MIN_REPEATS = 3
SMOKE_ENV = "RAYLIFT_BENCH_SMOKE"

Sample = dict[str, float]  # one command's figures from one run
Round = dict[str, Sample]  # every command's sample from one round
Command = Callable[[int], Mapping[str, float]]  # takes the round index (for unique run names)


class TargetMissed(AssertionError):
    """A benchmark missed a target. An AssertionError, so pytest reports a failed test."""


def env_int(name: str, default: int, minimum: int = 1) -> int:
    """A size or count from the environment, so a busy machine can run a smaller benchmark
    (and a quiet one more repeats) without editing the file."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number ≥ {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={value}: must be ≥ {minimum}")
    return value


def optional_env_int(name: str, minimum: int = 1) -> int | None:
    """`env_int` for a setting that may be left unset: None then (the code's own default
    applies, e.g. the job config's)."""
    if os.environ.get(name, "") == "":
        return None
    return env_int(name, minimum, minimum)


def smoke() -> bool:
    """Whether this is a smoke run (`make test`), not a measurement (`make bench`)."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


def size(name: str, full: int, smoke_size: int, minimum: int = 1) -> int:
    """A benchmark's size: the environment's, else `smoke_size` in a smoke run, else
    `full`."""
    return env_int(name, smoke_size if smoke() else full, minimum)


def repeats() -> int:
    """Rounds per benchmark: RAYLIFT_BENCH_REPEATS, default 3. Fewer than 3 gives no
    spread worth reporting, so it is refused rather than silently accepted; a smoke run
    does one."""
    if smoke():
        return 1
    return env_int(REPEATS_ENV, MIN_REPEATS, minimum=MIN_REPEATS)


def results_dir() -> Path:
    """build/bench, or build/bench/smoke for smoke runs (so they never overwrite a real
    measurement)."""
    return OUT / "smoke" if smoke() else OUT


@dataclass(frozen=True)
class Stats:
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return self.high - self.low

    @property
    def relative_spread(self) -> float:
        return self.spread / abs(self.median) if self.median else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "spread": self.spread,
            "relative_spread": self.relative_spread,
            "n": len(self.values),
            "values": list(self.values),
        }

    def describe(self) -> str:
        return (
            f"{fmt(self.median)} (median of {len(self.values)}; spread {fmt(self.spread)}, "
            f"{fmt(self.low)}–{fmt(self.high)})"
        )


@dataclass(frozen=True)
class Check:
    """A figure computed from one round and the target its median must meet. A check
    without a target is reported, never judged."""

    name: str
    figure: Callable[[Round], float]
    target: float | None = None
    higher_is_better: bool = True
    unit: str = ""

    @property
    def op(self) -> str:
        return "≥" if self.higher_is_better else "≤"

    def passes(self, value: float) -> bool | None:
        """None when there is no target. NaN never passes."""
        if self.target is None:
            return None
        if math.isnan(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target


def fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def interleave(
    commands: Mapping[str, Command],
    rounds: int,
    log: Callable[[str], None] = print,
    rotate: bool = False,
) -> list[Round]:
    """Run every command once per round, in the given order, `rounds` times:
    A, B, A, B, ... never A, A, B, B. `rotate`: round i starts at the i-th command
    (A, B, C / B, C, A / C, A, B), so no command always runs first after the previous
    round's last (whose teardown may still hold the cores) or always on a fresh cluster.
    Each round's figures keep the commands' order."""
    if not commands:
        raise ValueError("a benchmark needs at least one command")
    out: list[Round] = []
    names = list(commands)
    for i in range(rounds):
        this: Round = {}
        shift = i % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            command = commands[name]
            log(f"[round {i + 1}/{rounds}] {name} …")
            t0 = time.perf_counter()
            this[name] = {k: float(v) for k, v in command(i).items()}
            log(f"[round {i + 1}/{rounds}] {name} done in {time.perf_counter() - t0:.1f}s")
        out.append({name: this[name] for name in names})
    return out


def summarize(rounds: Sequence[Round]) -> dict[str, dict[str, Stats]]:
    """Stats per command and figure, over the rounds."""
    names = list(rounds[0])
    return {
        name: {key: Stats(tuple(r[name][key] for r in rounds)) for key in rounds[0][name]}
        for name in names
    }


def report(
    name: str,
    rounds: Sequence[Round],
    checks: Sequence[Check],
    *,
    title: str,
    metric: str,
    unit: str = "",
    setup: Mapping[str, Any] | None = None,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Write the JSON and the plot, print the verdicts, then raise if a target was missed
    (never in a smoke run, whose sizes say nothing about the targets)."""
    __tracebackhide__ = True  # pytest: show the verdicts, not this function's source
    out_dir = results_dir() if out_dir is None else out_dir
    is_smoke = smoke()
    if not rounds:
        raise ValueError(f"{name}: no rounds were run")
    per_command = summarize(rounds)
    results = []
    lines = []
    for check in checks:
        stats = Stats(tuple(float(check.figure(r)) for r in rounds))
        ok = check.passes(stats.median)
        verdict = "INFO" if ok is None else ("PASS" if ok else "MISS")
        target = "no target" if check.target is None else f"target {check.op} {check.target:g}"
        note = "  (smoke size: not judged)" if is_smoke and ok is not None else ""
        lines.append(
            f"{name} {check.name}: {stats.describe()} {check.unit}  {target}  {verdict}{note}"
        )
        results.append(
            {
                "name": check.name,
                "unit": check.unit,
                "target": check.target,
                "higher_is_better": check.higher_is_better,
                "verdict": verdict,
                "meets_target": ok,
                **stats.as_dict(),
            }
        )
    missed = [r["name"] for r in results if r["verdict"] == "MISS"]
    result = {
        "name": name,
        "title": title,
        "passed": not missed,
        "missed": missed,
        "smoke": is_smoke,
        "repeats": len(rounds),
        "order": [f"{cmd}#{i}" for i, r in enumerate(rounds) for cmd in r],
        "checks": results,
        "commands": {
            cmd: {key: s.as_dict() for key, s in figures.items()}
            for cmd, figures in per_command.items()
        },
        "setup": dict(setup or {}),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2))
    png_path = plot(result, metric, unit, out_dir / f"{name}.png")

    print(f"\n== {name}: {title}")
    for cmd, figures in per_command.items():
        if metric in figures:
            print(f"{name} {cmd}: {metric} {figures[metric].describe()} {unit}")
    for line in lines:
        print(line)
    print(f"→ {json_path}\n→ {png_path}")
    if missed and not is_smoke:
        raise TargetMissed(f"{name}: missed {', '.join(missed)}\n" + "\n".join(lines))
    return result


def plot(result: Mapping[str, Any], metric: str, unit: str, path: Path) -> Path:
    """Left: each command's `metric` (bar at the median, a dot per run). Then one panel per
    check: a dot per round, the median, and the target line, titled PASS or MISS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checks = result["checks"]
    fig, axes = plt.subplots(1, 1 + len(checks), figsize=(3.6 * (1 + len(checks)), 3.6))
    axes = list(axes) if checks else [axes]
    ax = axes[0]
    cmds = [c for c, figs in result["commands"].items() if metric in figs]
    for x, cmd in enumerate(cmds):
        s = result["commands"][cmd][metric]
        ax.bar(x, s["median"], color="tab:blue" if x == 0 else "tab:gray", alpha=0.7)
        ax.plot([x] * s["n"], s["values"], "k.", markersize=6)
    ax.set_xticks(range(len(cmds)), cmds, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{metric} ({unit})" if unit else metric)
    ax.set_title(f"{result['name']} ({result['repeats']} rounds)", fontsize=9)
    for ax, check in zip(axes[1:], checks, strict=True):
        colour = {"PASS": "tab:green", "MISS": "tab:red"}.get(check["verdict"], "tab:gray")
        ax.plot(range(1, check["n"] + 1), check["values"], "o", color=colour)
        ax.axhline(check["median"], color=colour, label="median")
        if check["target"] is not None:
            op = "≥" if check["higher_is_better"] else "≤"
            ax.axhline(
                check["target"],
                color="k",
                linestyle="--",
                label=f"target {op} {fmt(check['target'])}",
            )
        ax.set_xticks(range(1, check["n"] + 1))
        ax.set_xlabel("round")
        ax.set_ylabel(f"{check['name']} {check['unit']}".strip())
        ax.set_title(f"{check['name']}: {fmt(check['median'])} {check['verdict']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_benchmark(
    name: str,
    *,
    title: str,
    commands: Mapping[str, Command],
    checks: Sequence[Check],
    metric: str,
    unit: str = "",
    setup: Mapping[str, Any] | None = None,
    rounds: int | None = None,
    out_dir: Path | None = None,
    rotate: bool = False,
) -> dict[str, Any]:
    """Interleave the commands for `rounds` (default: RAYLIFT_BENCH_REPEATS) and report;
    `rotate`: each round starts one command further (see `interleave`)."""
    __tracebackhide__ = True
    done = interleave(commands, repeats() if rounds is None else rounds, rotate=rotate)
    return report(
        name, done, checks, title=title, metric=metric, unit=unit, setup=setup, out_dir=out_dir
    )


def trainer_job(
    assets: Mapping[str, Path], runs: Path, name: str, steps: int, block: int, micro: int,
    log_every: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """The job the trainer benchmarks run: the tiny model and corpus of `tools.tiny`, two
    workers, a constant learning rate, a metrics record every `log_every` steps."""
    return {
        "model": {"path": str(assets["model"]), "special_tokens": str(assets["tokens"])},
        "data": {"train_file": str(assets["train"]), "block_size": block},
        "train": {"micro_batch_size": micro, "max_steps": steps, "log_every": log_every},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "scaling": {"num_workers": 2},
        "storage": {"path": str(runs)},
        "run": {"name": name},
    }


def _steady(records: Sequence[Mapping[str, Any]], skip: float) -> Sequence[Mapping[str, Any]]:
    steps = [r for r in records if r.get("event") == "train"]
    return steps[int(len(steps) * skip) :]


def steady_tokens_per_s(records: Sequence[Mapping[str, Any]], skip: float = 0.2) -> float:
    """Tokens/s over a run's train records after the first `skip` share (warm-up)."""
    steady = _steady(records, skip)
    tokens = steady[-1]["tokens_seen"] - steady[0]["tokens_seen"]
    return tokens / (steady[-1]["time"] - steady[0]["time"])


def steady_window(records: Sequence[Mapping[str, Any]], skip: float = 0.2) -> tuple[float, float]:
    """The wall-clock span (time.time()) that `steady_tokens_per_s` measures."""
    steady = _steady(records, skip)
    return float(steady[0]["time"]), float(steady[-1]["time"])


def torch_or_ray_worker(cmdlines: Mapping[int, Sequence[str]], pid: int, ppid: int) -> bool:
    """A training process of the trainer benchmarks: a Ray Train worker (its process title
    is `ray::RayTrainWorker...`) or a process `torchrun` started (its parent runs
    `torch.distributed.run`)."""
    cmd = cmdlines.get(pid) or ()
    if cmd and cmd[0].startswith("ray::RayTrainWorker"):
        return True
    return "torch.distributed.run" in (cmdlines.get(ppid) or ())


class CpuWatch:
    """Where the machine's CPU went while a benchmark ran: the training processes against
    everything else (Ray's own processes, servers, the harness), sampled with psutil every
    `interval` seconds on a background thread.

        with CpuWatch(torch_or_ray_worker) as cpu:
            ...                        # run commands
            train, other = cpu.cores(t0, t1)   # mean cores over [t0, t1] (time.time())

    A window is widened to the samples around it. Training cores count the processes
    that were training at both ends of the window.
    """

    def __init__(
        self,
        is_training: Callable[[Mapping[int, Sequence[str]], int, int], bool],
        interval: float = 0.25,
    ):
        self.is_training = is_training
        self.interval = interval
        # (time, machine busy CPU-seconds, {training pid: its CPU-seconds})
        self.samples: list[tuple[float, float, dict[int, float]]] = []
        self._sampled = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _busy() -> float:
        import psutil

        t = psutil.cpu_times()
        # guest time is already inside user (Linux); idle and iowait are not busy.
        return sum(
            getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal")
        )

    def sample(self) -> None:
        import psutil

        procs = []
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times"]):
            if p.info["cpu_times"] is not None:
                procs.append(p.info)
        cmdlines = {i["pid"]: i["cmdline"] or () for i in procs}
        training = {
            i["pid"]: i["cpu_times"].user + i["cpu_times"].system
            for i in procs
            if self.is_training(cmdlines, i["pid"], i["ppid"])
        }
        with self._sampled:
            self.samples.append((time.time(), self._busy(), training))
            self._sampled.notify_all()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> CpuWatch:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def cores(self, t0: float, t1: float) -> tuple[float, float]:
        """(training cores, other cores), the mean over [t0, t1]; NaN without two samples
        around the window. A window that has just ended waits for the next sample."""
        if self._thread is not None and self._thread.is_alive():
            with self._sampled:
                self._sampled.wait_for(lambda: self.samples[-1][0] >= t1, 10 * self.interval)
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return math.nan, math.nan
        (ta, busy_a, train_a), (tb, busy_b, train_b) = before[-1], after[0]
        seconds = tb - ta
        train = sum(train_b[pid] - cpu for pid, cpu in train_a.items() if pid in train_b)
        return train / seconds, (busy_b - busy_a - train) / seconds
