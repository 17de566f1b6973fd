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
