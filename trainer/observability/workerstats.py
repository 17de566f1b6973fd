"""Per-worker memory and where the step goes, gathered to rank 0 once per logged step.

Each rank keeps a few counters between two logged steps: seconds spent waiting for data,
in forward+backward, in the optimizer step, in checkpoint saves and in eval, and the peak
memory since the last record (GPU: the allocator's max allocated and max reserved; CPU:
the process's peak RSS, `VmHWM`, reset through /proc/self/clear_refs). At a logged step
one all-gather of a small float vector brings every rank's values to rank 0, which
records min / mean / max across ranks and the rank holding the max, and every
`tracking.per_rank_every` logged steps every rank's values.

Times are host wall time. On a GPU, kernels run ahead of the host, so an unsynchronised
phase ends when the host is done queueing it; the next phase that waits (the loss
all-reduce in "data", or the optimizer's grad norm) absorbs the difference.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer.observability.device_memory import DEVICE_FIELDS, DevicePhases

log = logging.getLogger(__name__)

GIB = 1024**3
PHASES = ("data", "fwd_bwd", "optim", "ckpt", "eval", "snap")
"""Step phases, in the order a step runs them; `t_<phase>_s` in the records. `snap` is the
RAM tier's snapshot stall (trainer.checkpoint.memory), `ckpt` the storage checkpoint's."""
MEMORY = ("mem_peak_gib", "mem_reserved_gib", "mem_peak_pct", "host_rss_gib")
COUNTERS = ("alloc_retries", "ooms")
FIELDS = (*MEMORY, *COUNTERS, *(f"t_{p}_s" for p in PHASES), *DEVICE_FIELDS)
"""The per-rank values, in the order of the gathered vector."""


def _status_kib(key: str) -> float | None:
    """A `VmHWM:`/`VmRSS:` line of /proc/self/status, in KiB (Linux only)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def host_total_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return 0.0


class MemoryProbe:
    """Peak memory since the previous `sample()`; one object per rank."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.capacity_gib = torch.cuda.get_device_properties(device).total_memory / GIB
        else:
            self.capacity_gib = host_total_gib()
        # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0); where it
        # is not allowed, the peak is the process's peak so far.
        self._can_reset = not self.cuda and self._reset_hwm()

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def sample(self) -> dict[str, float]:
        rss = (_status_kib("VmRSS:") or 0.0) / (1024**2)
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            peak = stats.get("active_bytes.all.peak", 0) / GIB
            out = {
                "mem_peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
                "mem_reserved_gib": torch.cuda.max_memory_reserved(self.device) / GIB,
                "alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "ooms": float(stats.get("num_ooms", 0)),
            }
            out["mem_peak_gib"] = max(out["mem_peak_gib"], peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            hwm = (_status_kib("VmHWM:") or 0.0) / (1024**2)
            out = {
                "mem_peak_gib": max(hwm, rss),
                "mem_reserved_gib": max(hwm, rss),
                "alloc_retries": 0.0,
                "ooms": 0.0,
            }
            if self._can_reset:
                self._reset_hwm()
        out["mem_peak_pct"] = 100.0 * out["mem_reserved_gib"] / max(self.capacity_gib, 1e-9)
        out["host_rss_gib"] = rss
        return out


COMPUTE = ("data", "fwd_bwd", "optim")
"""The phases of the step itself (the rest are checkpoint, evaluation and snapshot stalls)."""


class StepTimer:
    """Seconds per phase since the last `take()`; `with timer.phase("optim"): ...`.
    `last_compute_s`: the last finished step's own phases (COMPUTE), which the cadence
    compares between steps with and without a write in flight."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.last_compute_s: float | None = None
        self._compute = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.seconds[name] += took
            if name in COMPUTE:
                self._compute += took

    def step_done(self) -> None:
        self.steps += 1
        self.last_compute_s, self._compute = self._compute, 0.0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def take(self) -> dict[str, float]:
        """Mean seconds per step of each phase over the steps since the last take."""
        n = max(self.steps, 1)
        out = {f"t_{p}_s": s / n for p, s in self.seconds.items()}
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        return out


def summarize(rows: list[list[float]]) -> dict[str, Any]:
    """min / mean / max across ranks and the max's rank, per field: `<field>_max` etc."""
    out: dict[str, Any] = {}
    for i, name in enumerate(FIELDS):
        col = [r[i] for r in rows]
        top = max(range(len(col)), key=col.__getitem__)
        out[f"{name}_min"] = min(col)
        out[f"{name}_mean"] = sum(col) / len(col)
        out[f"{name}_max"] = col[top]
        out[f"{name}_max_rank"] = top
    return out


class WorkerStats:
    """One per rank. `gather()` is collective: every rank calls it at every logged step."""

    def __init__(
        self,
        device: torch.device,
        rank: int,
        world_size: int,
        per_rank_every: int = 10,
        gauges: Any = None,
        group: Any = None,
    ):
        self.device = device
        # A gloo group on a GPU job (trainer.distributed.hostsync): the values are host numbers,
        # gathered in host memory without waiting for the device; None: the default group.
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.per_rank_every = per_rank_every
        self.timer = StepTimer()
        self.memory = MemoryProbe(device)
        self.device_phases = DevicePhases(device)  # device-level peak per phase (issue 47)
        self.gauges = gauges
        self._records = 0
        self._steps_done = 0

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        self.device_phases.on_step_phase(name, self._steps_done)
        return self.timer.phase(name)

    def step_done(self) -> None:
        self.timer.step_done()
        self._steps_done += 1

    def local(self) -> dict[str, float]:
        values = self.memory.sample()
        values.update(self.timer.take())
        values.update(self.device_phases.values())
        return values

    def gather(self) -> dict[str, Any]:
        """This rank's values to rank 0; rank 0 returns the fields for the metrics record,
        the others an empty dict."""
        mine = self.local()
        if self.gauges is not None:
            self.gauges.set(mine)
        values = [float(mine[f]) for f in FIELDS]
        if self.world_size > 1 and dist.is_initialized():
            on = self.device if self.group is None else torch.device("cpu")
            vec = torch.tensor(values, dtype=torch.float64, device=on)
            parts = [torch.empty_like(vec) for _ in range(self.world_size)]
            dist.all_gather(parts, vec, group=self.group)
            rows = [p.tolist() for p in parts]
        else:
            rows = [values]
        self._records += 1
        if self.rank != 0:
            return {}
        out = summarize(rows)
        out["mem_capacity_gib"] = self.memory.capacity_gib
        if self._records == 1 or self._records % self.per_rank_every == 0:
            out["per_rank"] = {name: [r[i] for r in rows] for i, name in enumerate(FIELDS)}
        return out


class RayGauges:
    """The same per-worker values as Ray metrics (`ray_raylift_<field>{run, rank}`), so
    Ray's dashboard and a Prometheus scrape of the cluster show them."""

    def __init__(self, run: str, rank: int):
        from ray.util.metrics import Gauge

        self.tags = {"run": run, "rank": str(rank)}
        self.gauges = {
            f: Gauge(
                f"raylift_{f}", description=f"Raylift per-worker {f}", tag_keys=("run", "rank")
            )
            for f in FIELDS
        }

    def set(self, values: dict[str, float]) -> None:
        try:
            for f, g in self.gauges.items():
                g.set(float(values[f]), tags=self.tags)
        except Exception as exc:  # metrics must never stop training
            log.debug("ray gauges not set: %s", exc)
