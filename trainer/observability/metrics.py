"""Metrics: MFU from a table of peak FLOP/s, and the run's metrics file.

The metrics file (`<storage>/<run>/metrics.jsonl`) is the run's history across restarts.
Every record carries the attempt that wrote it; when an attempt resumes from step k, the
records of earlier attempts past k were rolled back (trained, then lost) and the lineage
reader drops them, while `wasted_steps` counts them so preemption cost stays visible.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainer.planner.flops import PEAK_FLOPS, peak_flops  # noqa: F401  (re-exported)
from trainer.storage.location import Location

log = logging.getLogger(__name__)


def mfu(num_params: int, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation with the 6·N FLOPs-per-token estimate (forward + backward)."""
    if peak is None or peak <= 0:
        return None
    return 6.0 * num_params * tokens_per_s_per_device / peak


class MetricsFile:
    """Append-only JSONL history on local/shared FS or S3 (S3 is rewritten on flush)."""

    def __init__(self, loc: Location, existing: list[dict[str, Any]] | None = None):
        """`existing`: the file's records if the caller has just read them."""
        self.loc = loc
        self.attempt = 1  # which (re)start of the run is writing; set by the loop
        self._records: list[dict[str, Any]] = []
        self._dirty = False
        self._appendable = isinstance(loc.fs, pafs.LocalFileSystem)
        if not self._appendable:
            self._records = list(existing) if existing is not None else read_records(loc)

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
        """Rewrite the object (S3 has no append). A storage outage must not stop training:
        the records stay in memory and the next flush writes them."""
        if self._appendable or not self._dirty:
            return
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self._records).encode()
        try:
            with self.loc.fs.open_output_stream(self.loc.path) as f:
                f.write(body)
        except OSError as exc:
            log.warning("%s not written (%s); will retry at the next flush", self.loc.uri, exc)
            return
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
