"""Peak FLOP/s per device: pure data, shared by the run's MFU (observability.metrics) and
the planner's throughput estimate (planner.plan), which must import without torch or pyarrow."""

from __future__ import annotations

import re

# Dense (no sparsity) peak FLOP/s per device and compute dtype, from the vendors' data
# sheets. fp32 is the plain FP32 rate (no TF32). A10G is AWS's g5 part, whose tensor rate
# is lower than the A10's.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    # The H200 is the H100's chip with more and faster memory: the same dense rates.
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """Peak FLOP/s for a device name as torch reports it (e.g. 'NVIDIA A10G'); None for
    CPUs and unknown devices, which are reported as n/a rather than guessed."""
    if not device_name:
        return None
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for key in PEAK_FLOPS:
        if key in words:
            return PEAK_FLOPS[key].get(precision)
    return None
