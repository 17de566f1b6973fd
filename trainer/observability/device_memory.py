"""What OOMs is the device, not the allocator: a rank's device-level memory peak per phase
(load, first step, steady step, eval, checkpoint, export).

On CUDA the device-level figure is what the driver says is in use: NVML's count for this
process where pynvml is importable and sees it, else `torch.cuda.mem_get_info` (total -
free: the whole GPU, which is this rank's alone when a GPU runs one rank). It includes the
CUDA context, NCCL's buffers and everything the caching allocator holds. A thread samples
it while a phase runs (the peak between two samples can be missed by at most what one
phase allocates and frees within `interval_s`); the allocator's own peaks
(`max_memory_allocated` / `max_memory_reserved`, reset when the phase starts) come with it,
and with `settle=True` the reserved bytes left after `empty_cache()` when it ends (what a
later phase really inherits, rather than memory cached by the one before).

On CPU the stand-in is the process's resident set: the kernel's exact peak (`VmHWM`,
restarted at each phase through /proc/self/clear_refs), so the same code is tested here.
Do not combine it in one process with trainer.observability.workerstats.MemoryProbe on CPU,
which restarts the same counter.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

PHASES = ("load", "first_step", "steady_step", "eval", "checkpoint", "export")


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _restart_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current RSS
    except OSError:
        pass


class DeviceMemory:
    """Per-phase device-level peaks of one rank (`phase(name)` around each phase)."""

    def __init__(self, device: Any = None, interval_s: float = 0.02, settle: bool = False):
        import torch

        self.torch = torch
        dev = torch.device(device) if device is not None else None
        self.cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
        self.device = dev
        self.interval_s = interval_s
        self.settle = settle
        self.peaks: dict[str, dict[str, float]] = {}
        self._nvml: Any = None
        if self.cuda:
            self._nvml = _nvml_handle(dev.index if dev.index is not None else 0)

    # ------------------------------------------------------------ readings

    def used(self) -> int:
        """Device-level bytes in use now (CPU: resident set)."""
        if not self.cuda:
            return _status_bytes("VmRSS:")
        if self._nvml is not None:
            mine = _nvml_process_bytes(self._nvml)
            if mine:
                return mine
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total - free)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure one run of a phase; the phase's record keeps the largest run."""
        stop = threading.Event()
        peak = [self.used()]
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _restart_hwm()

        def sample() -> None:
            while not stop.wait(self.interval_s):
                peak[0] = max(peak[0], self.used())

        watcher = threading.Thread(target=sample, name=f"device-memory-{name}", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
            self._close(name, max(peak[0], self.used()))

    def _close(self, name: str, sampled: int) -> None:
        row: dict[str, float] = {}
        if self.cuda:
            cuda = self.torch.cuda
            if self.settle:
                cuda.synchronize(self.device)
            row["device_peak"] = float(max(sampled, self.used()))
            row["allocated_peak"] = float(cuda.max_memory_allocated(self.device))
            row["reserved_peak"] = float(cuda.max_memory_reserved(self.device))
            if self.settle:
                gc.collect()
                cuda.empty_cache()
                row["reserved_settled"] = float(cuda.memory_reserved(self.device))
                row["device_settled"] = float(self.used())
        else:
            row["device_peak"] = float(max(sampled, _status_bytes("VmHWM:")))
        old = self.peaks.get(name)
        if old is None or row["device_peak"] >= old["device_peak"]:
            self.peaks[name] = row

    # ------------------------------------------------------------ results

    @property
    def peak(self) -> float:
        """The largest device-level peak over every phase measured."""
        return max((r["device_peak"] for r in self.peaks.values()), default=0.0)

    def record(self, rank: int | None = None) -> dict[str, Any]:
        """The metrics record's fields: `dev_<phase>_gib` per phase and the overall peak."""
        out: dict[str, Any] = {
            f"dev_{k}_gib": v["device_peak"] / 2**30 for k, v in self.peaks.items()
        }
        out["dev_peak_gib"] = self.peak / 2**30
        out["dev_kind"] = "cuda" if self.cuda else "rss"
        if rank is not None:
            out["rank"] = rank
        return out


def _nvml_handle(index: int) -> Any:
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [x for x in visible.split(",") if x.strip()]
        physical = int(ids[index]) if index < len(ids) and ids[index].isdigit() else index
        return (pynvml, pynvml.nvmlDeviceGetHandleByIndex(physical))
    except Exception:  # no NVML here: mem_get_info is the fallback
        return None


def _nvml_process_bytes(handle: Any) -> int:
    pynvml, dev = handle
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(dev)
    except Exception:
        return 0
    pid = os.getpid()
    return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)


FINAL_DIR = "device_memory"
DEVICE_FIELDS = tuple(f"dev_{p}_gib" for p in PHASES)
"""The per-rank device-level peaks the worker stats gather (trainer.observability.workerstats)."""


class DevicePhases:
    """The training loop's per-phase device peaks: one sampler thread per rank reads the
    device-level figure (`DeviceMemory.used`) every `interval_s` and charges it to the phase
    the loop is in; `enter(name)` moves to the next phase. Peaks are the largest since the
    run started, per phase. The thread ends when this object is dropped or `close()`d.

    The worker stats drive it (trainer.observability.workerstats): load until the first
    step, the first step, the steady steps, eval, and after each record the checkpoint or
    export that follows it."""

    def __init__(self, device: Any = None, interval_s: float = 0.05):
        self.meter = DeviceMemory(device)
        self.interval_s = interval_s
        self.phase = "load"
        self.peaks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sample()
        ref = _weak(self)
        stop = self._stop
        self._thread = threading.Thread(
            target=_sampler, args=(ref, stop, interval_s), name="device-memory", daemon=True
        )
        self._thread.start()

    def _sample(self) -> None:
        used = float(self.meter.used())
        with self._lock:
            if used > self.peaks.get(self.phase, 0.0):
                self.peaks[self.phase] = used

    def enter(self, name: str) -> None:
        if name == self.phase:
            return
        self._sample()  # the phase that ends gets what is in use at its end
        with self._lock:
            self.phase = name
        self._sample()

    def on_step_phase(self, name: str, steps_done: int) -> None:
        """A step phase of the worker stats began: data starts the first or a steady step;
        eval is its own phase."""
        if name == "eval":
            self.enter("eval")
        elif name == "data":
            self.enter("first_step" if steps_done == 0 else "steady_step")

    def publishing(self, save: bool, export: bool) -> None:
        """What follows a step's record: an export or a checkpoint is its own phase."""
        if export:
            self.enter("export")
        elif save:
            self.enter("checkpoint")

    def values(self) -> dict[str, float]:
        self._sample()
        with self._lock:
            return {f"dev_{p}_gib": self.peaks.get(p, 0.0) / 2**30 for p in PHASES}

    def close(self) -> None:
        self._stop.set()

    def write_final(self, run: Any, rank: int) -> None:
        """Every phase's peak at the end of an attempt, beside the run's records
        (<run>/device_memory/rank<N>.json): the checkpoint and export after the last record
        never reach the metrics. A write that fails costs the run nothing."""
        import json
        import logging

        values = {**self.values(), "rank": rank, "kind": "cuda" if self.meter.cuda else "rss"}
        if self.meter.cuda:  # which GPU: the planner's history compares like with like
            values["device"] = self.meter.torch.cuda.get_device_name(self.meter.device)
        try:
            folder = run.join(FINAL_DIR)
            if not run.is_s3:
                run.fs.create_dir(folder.path, recursive=True)
            with run.fs.open_output_stream(folder.join(f"rank{rank}.json").path) as f:
                f.write(json.dumps(values).encode())
        except Exception as exc:  # the peaks are a report, never a reason to fail the run
            logging.getLogger(__name__).warning("device memory: not written (%s)", exc)
        self.close()


def read_final(run: Any) -> list[dict[str, Any]]:
    """The ranks' final per-phase peaks (write_final), by rank; empty when none were written."""
    import json

    from pyarrow import fs as pafs

    try:
        infos = run.fs.get_file_info(pafs.FileSelector(run.join(FINAL_DIR).path))
    except (OSError, FileNotFoundError):
        return []
    rows = []
    for info in infos:
        if info.base_name.startswith("rank") and info.base_name.endswith(".json"):
            with run.fs.open_input_stream(info.path) as f:
                rows.append(json.loads(f.read().decode()))
    return sorted(rows, key=lambda r: r.get("rank", 0))


def _weak(obj: Any) -> Any:
    import weakref

    return weakref.ref(obj)


def _sampler(ref: Any, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        obj = ref()
        if obj is None:
            return
        try:
            obj._sample()
        except Exception:  # a device gone at shutdown: stop sampling
            return
        del obj
