"""Experiment trackers (MLflow, W&B, TensorBoard): rank 0 only, never in the step's way.

One tracker run per Raylift run: the trackers' run ids live in `<run>/tracking.json`, so a
restarted worker group or a resubmission continues the same tracker run. Each tracker has
its own background sender (`sender.Sender`); the loop only queues. Points a tracker missed
(it was down when the previous attempt ended) are sent again from metrics.jsonl when the
next attempt starts, where the tracker can say which steps it has (MLflow).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainer.config import JobConfig
from trainer.observability.tracking.sender import Outcome, Sender
from trainer.storage.location import Location
from trainer.storage.transfer import upload_dir

log = logging.getLogger("trainer.observability.tracking")

STATE_FILE = "tracking.json"
FAILED_CLOSE_TIMEOUT_S = 10.0
# MLflow gets its metric records up to 16 a call (about 1000 metrics, its limit per call
# for records of ~60 values), the first waiting at most 5 s for the rest: a chart up to
# 5 s behind, for 7 ms of CPU per record instead of 19 (trainer.observability.tracking.sender).
MLFLOW_LINGER_S = 5.0
MLFLOW_MAX_BATCH = 16
"""The most a failed attempt waits for trackers to take what is queued (Ray tears its
worker group down soon after); otherwise `tracking.close_timeout_s`."""

_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|key|apikey|credentials?)$", re.I)
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)


def redact(value: Any) -> Any:
    """Credentials written into URIs (scheme://user:pass@host) are replaced by ***."""
    if isinstance(value, str):
        return _USERINFO.sub(r"\g<scheme>***@", value)
    return value


def flat_config(cfg: JobConfig) -> dict[str, str]:
    """The resolved config as dotted keys with string values, secrets removed."""
    return flatten(cfg.model_dump(mode="json"))


def flatten(data: dict[str, Any]) -> dict[str, str]:
    """Dotted keys, string values; a key named like a secret (`*_token`, `password`, ...)
    has its value replaced by ***, and so has a URI's user:password@."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
            return
        if _SECRET_KEY.search(prefix.rsplit(".", 1)[-1]):
            out[prefix] = "***"
        else:
            out[prefix] = str(redact(json.dumps(node) if isinstance(node, list) else node))

    walk(data, "")
    return out


def read_state(run: Location) -> dict[str, Any]:
    try:
        with run.fs.open_input_stream(run.join(STATE_FILE).path) as f:
            return json.loads(f.read().decode())
    except (OSError, json.JSONDecodeError, FileNotFoundError):
        return {}


class NullTracker:
    """What every rank but 0 (and a run without trackers) gets."""

    names: tuple[str, ...] = ()

    def metrics(self, record: dict[str, Any]) -> None:
        pass

    def tag(self, key: str, value: str) -> None:
        pass

    def events(self, records: list[dict[str, Any]]) -> None:
        pass

    def table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows for a tracker's table at a step (RL's sampled completions); trackers
        without tables ignore them (the rows are in the run folder too)."""

    def flush(self) -> None:
        pass

    def close(self, status: str) -> list[Outcome]:
        return []


_ACTIVE: list[Tracker] = []


def close_active(status: str) -> None:
    """An attempt that raised: give its trackers a last chance (W&B writes its offline
    file in batches; what it holds is otherwise lost with the process)."""
    for t in list(_ACTIVE):
        try:
            t.close(status)
        except Exception as exc:  # the original error is what matters
            log.warning("trackers not closed: %s", exc)


class Tracker(NullTracker):
    def __init__(
        self,
        cfg: JobConfig,
        run: Location,
        attempt: int,
        start: int,
        history: list[dict[str, Any]],
    ):
        self.cfg, self.run, self.attempt, self.start = cfg, run, attempt, start
        self.state = read_state(run)
        self._lock = threading.Lock()
        self._local = isinstance(run.fs, pafs.LocalFileSystem)
        self._tmp: Path | None = None
        self._uploads: list[tuple[Path, Location]] = []
        self.backends: dict[str, Any] = {}
        self.senders: dict[str, Sender] = {}
        self._queued: dict[str, float] = {}  # events queued this attempt, per tracker
        t = cfg.tracking
        from trainer.observability.tracking import backends as b

        if t.mlflow is not None:
            self.backends["mlflow"] = b.MlflowBackend(
                t.mlflow.tracking_uri, t.mlflow.experiment, cfg.run.name
            )
        if t.wandb is not None:
            folder = self._folder("wandb", None).parent  # W&B writes into <dir>/wandb/
            self.backends["wandb"] = b.WandbBackend(
                t.wandb.project, t.wandb.entity, t.wandb.mode, cfg.run.name, folder, start
            )
        if t.tensorboard is not None:
            folder = self._folder("tensorboard", t.tensorboard.dir)
            self.backends["tensorboard"] = b.TensorBoardBackend(folder, attempt, start)
        self.names = tuple(self.backends)
        _ACTIVE.append(self)
        if "wandb" in self.backends and not self.state.get("wandb"):
            # W&B takes the id we give it: store it now, so an attempt that dies before
            # W&B answered still leaves the id the next attempt continues.
            self.state["wandb"] = uuid.uuid4().hex[:16]
            self._write_state()
        params = flat_config(cfg)
        for name, backend in self.backends.items():
            if (
                name == "mlflow"
            ):  # records go several to a call (trainer.observability.tracking.sender)
                s = Sender(
                    name,
                    limit=t.buffer,
                    batch=backend.metrics_many,
                    linger_s=MLFLOW_LINGER_S,
                    max_batch=MLFLOW_MAX_BATCH,
                )
            else:
                s = Sender(name, limit=t.buffer)
            self.senders[name] = s
            s.put("open", lambda n=name, be=backend: self._open(n, be))
            s.put("config", lambda be=backend: be.params_(params))
            if name == "mlflow":
                # Steps it missed (it asks the run which it has, so nothing is sent twice).
                for rec in history:
                    if int(rec["step"]) <= start:
                        self._put_metrics(name, backend, rec)

    def _folder(self, name: str, configured: str | None) -> Path:
        """Where a tracker writes files: the run folder itself on a local/shared FS, else a
        temporary folder copied to <run>/<name>/ at checkpoints and at the end."""
        if configured:
            return Path(configured)
        if self._local:
            return Path(self.run.join(name).path)
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="raylift-tracking-"))
        folder = self._tmp / name
        self._uploads.append((folder, self.run.join(name)))
        return folder

    def _write_state(self) -> None:
        """tracking.json, merged with what is there (each sender adds its own id)."""
        with self._lock:
            self.state = {**read_state(self.run), **self.state}
            body = json.dumps(self.state, indent=1, sort_keys=True).encode()
            self.run.fs.create_dir(self.run.path, recursive=True)
            with self.run.fs.open_output_stream(self.run.join(STATE_FILE).path) as f:
                f.write(body)

    def _open(self, name: str, backend: Any) -> None:
        run_id = backend.open(self.state.get(name))
        if self.state.get(name) != run_id:
            self.state[name] = run_id
            self._write_state()
        log.info("tracker %s: run %s", name, run_id)

    def _put_metrics(self, name: str, backend: Any, record: dict[str, Any]) -> None:
        """(step, tracker keys, time) of a record: a batch sender's payload, or the
        arguments of the backend's `metrics` call."""
        args = (int(record["step"]), flatten_record(record), float(record.get("time") or 0.0))
        sender = self.senders[name]
        if sender.batch is None:
            sender.put("metrics", lambda: backend.metrics(*args))
        else:
            sender.put("metrics", None, payload=args)

    def metrics(self, record: dict[str, Any]) -> None:
        for name, backend in self.backends.items():
            self._put_metrics(name, backend, record)

    def tag(self, key: str, value: str) -> None:
        for name, backend in self.backends.items():
            self.senders[name].put("tag", lambda be=backend: be.tag(key, value))

    def table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        for tracker, backend in self.backends.items():
            if rows and hasattr(backend, "table"):
                call = functools.partial(backend.table, name, step, rows)
                self.senders[tracker].put("table", call, points=0)

    def events(self, records: list[dict[str, Any]]) -> None:
        """Journal events (restarts, spot notices, failures, checkpoints) a tracker has not
        had yet: `tracking.json` keeps, per tracker, the time of the last one it took."""
        for name, backend in self.backends.items():
            key = f"events_until.{name}"
            since = self._queued.get(name, float(self.state.get(key, 0.0)))
            new = [r for r in records if float(r.get("time", 0.0)) > since]
            for r in new:
                self.senders[name].put("event", self._event_call(name, backend, r))
            if new:
                self._queued[name] = max(float(r["time"]) for r in new)

    def _event_call(self, name: str, backend: Any, r: dict[str, Any]) -> Any:
        step = int(r.get("step", r.get("from_step", 0)) or 0)
        fields = {k: v for k, v in r.items() if k != "time"}
        when = float(r["time"])

        def call() -> None:
            backend.event(step, r["event"], fields, when)
            key = f"events_until.{name}"
            self.state[key] = max(float(self.state.get(key, 0.0)), when)

        return call

    def flush(self) -> None:
        """At a checkpoint: event files to disk, and to the run folder when it is remote."""
        tb = self.backends.get("tensorboard")
        if tb is not None:
            self.senders["tensorboard"].put("flush", tb.flush, points=0)
        sender = self.senders.get("tensorboard") or self.senders.get("wandb")
        if self._uploads and sender is not None:
            sender.put("upload", self._upload, points=0)

    def _upload(self) -> None:
        for folder, target in self._uploads:
            if folder.exists():
                upload_dir(folder, target)

    def close(self, status: str) -> list[Outcome]:
        """Last sends, within one deadline for all trackers (a failed attempt gets less:
        Ray tears its worker group down soon after)."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for name, backend in self.backends.items():
            self.senders[name].put("close", lambda be=backend: be.close(status), points=0)
        timeout = self.cfg.tracking.close_timeout_s
        if status == "failed":
            timeout = min(timeout, FAILED_CLOSE_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        outcomes = [s.close(max(0.0, deadline - time.monotonic())) for s in self.senders.values()]
        try:  # events_until for the next attempt
            self._write_state()
        except OSError as exc:
            log.warning("%s not written: %s", STATE_FILE, exc)
        try:
            self._upload()
        except OSError as exc:
            log.warning("tracker files not copied to %s: %s", self.run.uri, exc)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        for o in outcomes:
            if o.unsent or o.dropped:
                log.warning(
                    "tracker %s: %d points not sent (%d dropped from a full buffer, last "
                    "error: %s); every one is in metrics.jsonl",
                    o.name,
                    o.unsent + o.dropped,
                    o.dropped,
                    o.error,
                )
        return outcomes


def flatten_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as tracker keys: `per_rank` becomes `rank<r>/<field>`."""
    out = {
        k: v for k, v in record.items() if k not in ("per_rank", "event", "attempt", "step", "time")
    }
    for field, values in (record.get("per_rank") or {}).items():
        for r, v in enumerate(values):
            out[f"rank{r}/{field}"] = v
    return out


def open_tracker(
    cfg: JobConfig, run: Location, rank: int, attempt: int, start: int, history: list[dict]
) -> NullTracker:
    if rank != 0 or cfg.train.as_test or not cfg.tracking.trackers:
        return NullTracker()
    return Tracker(cfg, run, attempt, start, history)
