"""Agreement between ranks that never waits for the accelerator.

A step's decisions are host numbers every rank must agree on: the loss divisor's target
count (counted from the batch's labels before they reach the device), the preemption and
RAM-tier flags, the report's "time to tell Ray". All-reduced as a CUDA tensor and read back,
each is a host-device synchronisation: the host waits for every kernel queued before it and
stops running ahead of the GPU (gpu-check counts them with `torch.cuda.set_sync_debug_mode`).
Reduced on a gloo group in host memory, every rank gets the very same sums (float64 sums of
counts and flags are exact in any order) and the GPU keeps its queue. On CPU the default
group already reduces host memory, so nothing changes there.

What the device itself holds (the step's loss, the grad norm) is read once, both values in
one copy, and only on a step whose record is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class HostReduce:
    """Sums lists of host floats over every rank. Making one is collective on a CUDA job
    with several ranks (the gloo group), so every rank makes it at the same point."""

    def __init__(self, device: torch.device, world: int):
        self.world = world
        self.group: Any = None
        if world > 1 and dist.is_initialized() and device.type != "cpu":
            self.group = dist.new_group(backend="gloo")

    def __call__(self, values: Sequence[float]) -> list[float]:
        if self.world == 1 or not dist.is_initialized():
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()


def to_device(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar on `device` without waiting for it: a plain `torch.tensor(v,
    device="cuda")` copies from pageable memory and synchronises the stream; a pinned
    buffer copied asynchronously is safe (the host allocator keeps it until the copy ran)."""
    t = torch.tensor(value)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def read_floats(*values: Any) -> list[float | None]:
    """Python floats of `values` (0-dim tensors, numbers or None), the tensors read in one
    device-to-host copy: one synchronisation for all of them, none when nothing is a tensor."""
    tensors = [v for v in values if torch.is_tensor(v)]
    got: list[float] = []
    if tensors:
        where = tensors[0].device
        stacked = torch.stack([t.detach().reshape(()).to(where, torch.float64) for t in tensors])
        got = stacked.tolist()
    it = iter(got)
    return [None if v is None else (next(it) if torch.is_tensor(v) else float(v)) for v in values]
