"""The run journal: what happened to a run, beside its checkpoints in storage.

`<storage>/<run>/journal/` holds one JSON-lines file per writing process (a training
attempt's rank 0, the Ray Train controller, a driver), so no two processes ever write
the same object: S3 has no append, and a shared FS gives no atomic append across nodes.
Readers merge the files by time. Events (each a JSON object with `time`, `event`,
`source`):

- `attempt`: an attempt (worker group) started: `attempt`, `after` (`start`, `stop`: a
  resubmission after a clean stop, `failure`: a restart), `world_size`, `from_step`,
  `restored_from` (`storage`, `memory-own`: the RAM tier's keepers, every share from
  its writer's node; `memory-buddy`: some share from a buddy copy; None: from scratch),
  `lost_steps` (steps trained past the checkpoint or snapshot it resumed from), `lost_s`
  (wall time from the last step before the failure to the first step of this attempt),
  `pool` (rank 0's node: `instance_type`, `market`, `nodes`, `gpus_per_node`, and a
  drill's `drill_rate_per_hour`; what later runs' cadences count its faults for:
  trainer.planner.fault_history).
- `failure`: the controller saw the worker group fail: `cause` (`worker_died`,
  `node_lost`, `preempted`, `error`), `ranks`, `message`.
- `preemption`: a spot notice reached the loop: `step`, `deadline_s` (seconds left when
  seen), `save_s` (the emergency checkpoint), `margin_s` (deadline left after saving).
- `checkpoint`: `step`, `kind` (`periodic`, `emergency`, `final`), `save_s` (what the
  training step spent: staging copies, small files), `write_wait_s` (the upload's wait
  for the background write of the staged state), `upload_s` (persisting the files;
  async uploads report when done).
- `upload_retry`: a transient storage error during an upload, retried: `step`, `error`.
  Every rank journals its own (rank 0 in its attempt's file, another rank in a file of
  its own, made at its first retry): with uploads per rank, any of them may be the one
  that met the outage.
- `rebalance`: an EC2 rebalance recommendation on a node of the run reached the loop
  (trainer.resilience.rebalance): `step`, `ranks` (how many saw it), `shortened` (the
  auto cadence's intervals shortened), `burst_s` (for how long).
- `finished`: the run reached its last step.
- `driver`: a driver (submission) started: `submission`, `resubmit`.

Writing is best effort: a journal that cannot be written never stops training, it
logs a warning.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pyarrow.fs as pafs

from trainer.storage.location import Location

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"


class Journal:
    """One process's journal file: `journal/<source>.jsonl`, rewritten on each event."""

    def __init__(self, run: Location, source: str):
        self.run = run
        self.source = source
        self.loc = run.join(JOURNAL_DIR, f"{source}.jsonl")
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # async uploads journal from Ray's upload thread
        self.unwritten = False  # the last write failed: `flush` tries again

    def add(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "source": self.source, **fields}
        with self._lock:
            self._records.append(record)
            self._write()
        return record

    def flush(self) -> None:
        """Write again if the last write failed (an event journaled during an outage is
        kept in memory; the next event or this call writes it once storage answers)."""
        with self._lock:
            if self.unwritten:
                self._write()

    def _write(self) -> None:
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self._records)
        try:
            self.run.fs.create_dir(self.run.join(JOURNAL_DIR).path, recursive=True)
            with self.run.fs.open_output_stream(self.loc.path) as f:
                f.write(body.encode())
            self.unwritten = False
        except OSError as exc:
            self.unwritten = True
            log.warning("journal %s not written (%s); training goes on", self.loc.uri, exc)


def read(run: Location) -> list[dict[str, Any]]:
    """Every journal record of a run, oldest first."""
    sel = pafs.FileSelector(run.join(JOURNAL_DIR).path, allow_not_found=True)
    try:
        infos = run.fs.get_file_info(sel)
    except OSError:
        return []
    records: list[dict[str, Any]] = []
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.endswith(".jsonl"):
            continue
        try:
            with run.fs.open_input_stream(info.path) as f:
                text = f.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed writer
    return sorted(records, key=lambda r: r.get("time", 0.0))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers a user asks after a bumpy run: restarts, what each cost, checkpoints."""
    attempts = [r for r in records if r["event"] == "attempt"]
    failures = [r for r in records if r["event"] == "failure"]
    ckpts = [r for r in records if r["event"] == "checkpoint"]
    preemptions = [r for r in records if r["event"] == "preemption"]
    # Restarts after a failure; a resubmission after a clean stop costs nothing.
    restarts = [a for a in attempts[1:] if a.get("after", "failure") == "failure"]
    causes: dict[str, int] = {}
    for f in failures:
        causes[f["cause"]] = causes.get(f["cause"], 0) + 1

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "attempts": len(attempts),
        "restarts": len(restarts),
        "failures": causes,
        "lost_steps": [int(r.get("lost_steps", 0)) for r in restarts],
        "lost_s": sum(float(r.get("lost_s") or 0.0) for r in restarts),
        "preemptions": [
            {k: p.get(k) for k in ("step", "deadline_s", "save_s", "margin_s")} for p in preemptions
        ],
        "checkpoints": len(ckpts),
        "mean_save_s": mean("save_s", ckpts),
        "mean_upload_s": mean("upload_s", ckpts),
        "upload_retries": sum(1 for r in records if r["event"] == "upload_retry"),
        "finished": any(r["event"] == "finished" for r in records),
    }


def finished(run: Location) -> bool:
    return any(r["event"] == "finished" for r in read(run))
