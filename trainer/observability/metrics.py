"""Metrics: MFU from a table of peak FLOP/s, and the run's metrics file.

The metrics file (`<storage>/<run>/metrics.jsonl`) is the run's history across restarts.
Every record carries the attempt that wrote it; when an attempt resumes from step k, the
records of earlier attempts past k were rolled back (trained, then lost) and the lineage
reader drops them, while `wasted_steps` counts them so preemption cost stays visible.
"""

from __future__ import annotations

import json
import logging
import threading
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


def active_params(n_params: int, model: Any) -> int:
    """The parameters a token runs through, what MFU's 6·N counts: `n_params` (the
    strategy's whole-model count, adapters and grown embeddings included) less the routed
    experts of a mixture-of-experts model that a token is not sent to, as the planner
    counts them (trainer.planner.shape); `n_params` for a dense model or a module without
    a Hugging Face config. Counting every expert would overstate a 30B-A3B's MFU ~9×."""
    from trainer.errors import UserError
    from trainer.planner.shape import ModelShape

    conf = next(
        (m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")),
        None,
    )
    if conf is None:
        return n_params
    try:
        shape = ModelShape.from_hf_config(conf.to_dict())
    except UserError:  # not a decoder config the planner reads: count every parameter
        return n_params
    return n_params - (shape.params - shape.active_params)


FLUSH_EVERY_S = 15.0
"""On object storage (no append) the history is one object, rewritten whole at each
checkpoint and, in between, at most this often by a background thread off the step's
path. A hard kill between checkpoints then takes at most this long of records with it,
and the next attempt counts the steps it lost (the journal) from what was written."""


class MetricsFile:
    """Append-only JSONL history on local/shared FS (a line per record, at once) or S3
    (rewritten on flush: at each checkpoint and every `flush_every_s` in between)."""

    def __init__(
        self,
        loc: Location,
        existing: list[dict[str, Any]] | None = None,
        flush_every_s: float = FLUSH_EVERY_S,
    ):
        """`existing`: the file's records if the caller has just read them."""
        self.loc = loc
        self.attempt = 1  # which (re)start of the run is writing; set by the loop
        self._lines: list[str] = []
        self._dirty = False
        self._lock = threading.Lock()  # the lines and the dirty flag
        self._writing = threading.Lock()  # one rewrite at a time
        self._closed = threading.Event()
        self._appendable = isinstance(loc.fs, pafs.LocalFileSystem)
        if not self._appendable:
            old = existing if existing is not None else read_records(loc)
            self._lines = [json.dumps(r, sort_keys=True) for r in old]
            if flush_every_s > 0:
                threading.Thread(
                    target=self._flush_every,
                    args=(flush_every_s,),
                    name="raylift-metrics-flush",
                    daemon=True,
                ).start()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        if self._appendable:
            Path(self.loc.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.loc.path, "a") as f:
                f.write(line + "\n")
            return
        with self._lock:
            self._lines.append(line)
            self._dirty = True

    def flush(self) -> None:
        """Rewrite the object (S3 has no append). A storage outage must not stop training:
        the records stay in memory and the next flush writes them."""
        if self._appendable:
            return
        with self._writing:
            with self._lock:
                if not self._dirty:
                    return
                upto = len(self._lines)
                self._dirty = False
            # Lines are only ever appended: the first `upto` are joined outside the lock,
            # so a step's write() never waits for a long history to be joined.
            body = "".join(line + "\n" for line in self._lines[:upto]).encode()
            try:
                with self.loc.fs.open_output_stream(self.loc.path) as f:
                    f.write(body)
            except OSError as exc:
                log.warning("%s not written (%s); will retry at the next flush", self.loc.uri, exc)
                with self._lock:
                    self._dirty = True

    def _flush_every(self, seconds: float) -> None:
        while not self._closed.wait(seconds):
            self.flush()

    def close(self) -> None:
        """The last flush; the background one stops."""
        self._closed.set()
        self.flush()


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
