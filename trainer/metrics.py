"""Metrics: MFU from a table of peak FLOP/s, and the run's metrics file.

The metrics file (`<storage>/<run>/metrics.jsonl`) is the run's history across restarts.
Every record carries the attempt that wrote it; when an attempt resumes from step k, the
records of earlier attempts past k were rolled back (trained, then lost) and the lineage
reader drops them, while `wasted_steps` counts them so preemption cost stays visible.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainer.storage import Location

log = logging.getLogger(__name__)

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


def mfu(num_params: int, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation with the 6·N FLOPs-per-token estimate (forward + backward)."""
    if peak is None or peak <= 0:
        return None
    return 6.0 * num_params * tokens_per_s_per_device / peak


class MetricsFile:
    """Append-only JSONL history on local/shared FS or S3 (S3 is rewritten on flush)."""

    def __init__(self, loc: Location):
        self.loc = loc
        self.attempt = 1  # which (re)start of the run is writing; set by the loop
        self._records: list[dict[str, Any]] = []
        self._dirty = False
        self._appendable = isinstance(loc.fs, pafs.LocalFileSystem)
        if not self._appendable:
            self._records = read_records(loc)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        if self._appendable:
            Path(self.loc.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.loc.path, "a") as f:
                f.write(line + "\n")
        else:
            self._records.append(record)
            self._dirty = True

    def flush(self) -> None:
        if self._appendable or not self._dirty:
            return
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self._records).encode()
        with self.loc.fs.open_output_stream(self.loc.path) as f:
            f.write(body)
        self._dirty = False


def read_records(loc: Location) -> list[dict[str, Any]]:
    try:
        with loc.fs.open_input_stream(loc.path) as f:
            text = f.read().decode()
    except FileNotFoundError:
        return []
    except OSError as exc:
        if "not found" in str(exc).lower() or "NoSuchKey" in str(exc):
            return []
        raise
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                # A torn last line from a killed writer: history before it is still good.
                log.warning("%s: ignoring a torn line", loc.uri)
    return out


def lineage(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The step records that make up the final model, in order, and how many steps were
    trained and then lost to a restart (wasted). A `resume` event from step k discards
    earlier step records with step > k."""
    kept: list[dict[str, Any]] = []
    wasted = 0
    for rec in records:
        if rec.get("event") == "resume":
            k = int(rec["from_step"])
            lost = [r for r in kept if r["step"] > k]
            wasted += len(lost)
            kept = [r for r in kept if r["step"] <= k]
        elif "step" in rec and rec.get("event", "train") == "train":
            kept.append(rec)
    return kept, wasted
