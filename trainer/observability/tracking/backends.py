"""One small class per tracker. Every method runs on that tracker's sender thread.

A backend's `open()` creates or continues the tracker run whose id `tracking.json` holds,
and returns the id to store. Steps rolled back by a restart are handled per tracker:

- MLflow keeps every value logged at a step, so the backend asks the run which steps it
  already has and never logs a step twice: a rolled-back step keeps the value the lost
  attempt logged, which exact resume makes the same loss (timings differ).
- TensorBoard: the attempt's writer starts with `purge_step` = first step it trains, so
  TensorBoard discards the lost attempt's points from that step on.
- W&B (online) continues the run with `resume="allow"`; W&B drops steps below its last
  one. Offline, W&B ignores resume and writes one folder per attempt (`wandb sync` them
  in order); each attempt's folder starts at the step it resumed from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("trainer.observability.tracking")


def _scalars(values: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and v == v
    }


def prepare_mlflow_store(uri: str) -> None:
    """Create a local SQLite MLflow store whole, on the driver, before any worker starts.

    MLflow creates its schema on first use (some thirty migrations). A rank killed in the
    middle of that leaves a database with half its tables, which every later client, the
    next attempt's included, fails to open ("table ... already exists"). Here the schema
    is built in a side file and linked into place only when complete, so a kill at any
    moment leaves either no database or a whole one. An existing database that cannot be
    opened is refused in one line. Server URIs (http, databricks) are left to the sender.
    """
    from sqlalchemy.engine import make_url

    if not uri.startswith("sqlite:"):
        return
    from mlflow.tracking import MlflowClient

    from trainer.errors import UserError

    database = make_url(uri).database
    if not database or database == ":memory:":
        raise UserError(f"tracking.mlflow.tracking_uri {uri}: name a database file")
    path = Path(database).expanduser().resolve()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        side = path.with_name(f".{path.name}.init-{os.getpid()}")
        try:
            MlflowClient(tracking_uri=f"sqlite:///{side}").search_experiments(max_results=1)
            with contextlib.suppress(FileExistsError):  # never over another driver's
                os.link(side, path)
        finally:
            side.unlink(missing_ok=True)
    try:
        MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)
    except Exception as exc:
        lines = [x for x in str(exc).splitlines() if x.strip()]
        raise UserError(
            f"tracking.mlflow.tracking_uri {uri}: the database cannot be opened "
            f"({(lines[0] if lines else type(exc).__name__)[:200]}); a process killed while "
            "creating it leaves it half made: move it away and submit again"
        ) from None


class MlflowBackend:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str):
        # One failed request must fail fast: the sender retries, not mlflow's HTTP layer
        # (whose default backoff holds a request for minutes).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client: Any = None
        self.run_id: str | None = None
        self.steps: set[int] = set()
        self.params: dict[str, str] = {}

    def open(self, run_id: str | None) -> str:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            run = self.client.get_run(run_id)
            self.params = dict(run.data.params)
            self.steps = {m.step for m in self.client.get_metric_history(run_id, "loss")}
            self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
            run_id = self.client.create_run(
                exp_id, run_name=self.run_name, tags={"raylift.run": self.run_name}
            ).info.run_id
        self.run_id = run_id
        return run_id

    def params_(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        new = {k: v[:6000] for k, v in params.items() if k not in self.params}
        changed = {k: v for k, v in params.items() if k in self.params and self.params[k] != v}
        items = list(new.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
        self.params.update(new)
        for k, v in changed.items():  # a param cannot change: keep the newest as a tag
            self.client.set_tag(self.run_id, f"raylift.changed.{k}", v[:5000])

    def metrics(self, step: int, values: dict[str, Any], when: float) -> None:
        self.metrics_many([(step, values, when)])

    def metrics_many(self, records: list[tuple[int, dict[str, Any], float]]) -> None:
        """Several records' metrics in as few `log_batch` calls as MLflow allows (1000
        metrics a call): its store spends most of a call on the call itself."""
        from mlflow.entities import Metric

        items, steps = [], []
        for step, values, when in records:
            if step in self.steps or step in steps:
                continue
            ms = int(when * 1000)
            items += [Metric(k.replace("/", "."), v, ms, step) for k, v in _scalars(values).items()]
            steps.append(step)
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])
        self.steps.update(steps)

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value[:5000])

    def event(self, step: int, name: str, fields: dict[str, Any], when: float) -> None:
        import json

        key = f"raylift.event.{int(when * 1000)}"
        self.client.set_tag(self.run_id, key, json.dumps(fields)[:5000])

    def table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """One JSON table artifact per logged step (`<name>/step_<step>.json`, MLflow's
        `log_table` format, which its UI shows as a table). `log_table` appends to a file
        that exists, so a step retrained after a restart keeps the table the lost attempt
        logged, as its metrics do, instead of holding its rows twice."""
        path = f"{name}/step_{step:08d}.json"
        if any(f.path == path for f in self.client.list_artifacts(self.run_id, name)):
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = {c: [r.get(c) for r in rows] for c in columns}
        self.client.log_table(self.run_id, data=data, artifact_file=path)

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if status == "finished" else status)


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, logdir: Path, attempt: int, start: int):
        self.logdir, self.attempt, self.start = logdir, attempt, start
        self.writer: Any = None

    def open(self, run_id: str | None) -> str:
        from tensorboardX import SummaryWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        # One folder, one event file per attempt (its name carries the attempt, as
        # tensorboardX names files by second and host only); the purge step drops the
        # points of a lost attempt from the step this one resumed from.
        self.writer = SummaryWriter(
            logdir=str(self.logdir),
            purge_step=self.start + 1 if self.attempt > 1 else None,
            filename_suffix=f".attempt-{self.attempt}",
            flush_secs=30,
        )
        return run_id or str(self.logdir)

    def params_(self, params: dict[str, str]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(params.items()))
        self.writer.add_text("config", text, global_step=self.start)

    def metrics(self, step: int, values: dict[str, Any], when: float) -> None:
        """One event per record, holding every scalar of it (a summary with many values,
        as TensorFlow's merged summaries write; TensorBoard reads each value as its own
        series). `add_scalar` per value cost 7.4 ms of CPU per 54-value record here, most
        of it tensorboardX passing each event through a multiprocessing queue; one event,
        1.5 ms. (`_get_file_writer` is what `add_scalar` itself calls; tensorboardX is
        pinned.)"""
        from tensorboardX.proto.summary_pb2 import Summary

        scalars = _scalars(values)
        if scalars:
            summary = Summary(
                value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
            )
            self.writer._get_file_writer().add_summary(summary, step, when)

    def tag(self, key: str, value: str) -> None:
        self.writer.add_text(key, value, global_step=self.start)

    def event(self, step: int, name: str, fields: dict[str, Any], when: float) -> None:
        import json

        self.writer.add_text(f"events/{name}", json.dumps(fields), global_step=step, walltime=when)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


WANDB_SERVICE = "WANDB_SERVICE"


def drop_inherited_wandb_service() -> str | None:
    """Forget a W&B service token this process inherited (returned; None if none).

    W&B keeps the token of the service process it starts in the environment, so every
    child process of one that used W&B inherits it (a Ray cluster started from such a
    process passes it on to every worker) and connects to that one service. A service
    shared that way outlives a killed rank 0 with the run's stream still open, and the
    restarted rank's `wandb.init` of the same run id then fails with "run ID ... is in
    use" for as long as the service lives. Rank 0 therefore starts its own service: a
    token keeps only if this very process started its service (the token's second field
    is that process's pid)."""
    token = os.environ.get(WANDB_SERVICE)
    if not token:
        return None
    fields = token.split("-")
    if len(fields) > 1 and fields[1] == str(os.getpid()):
        return None
    del os.environ[WANDB_SERVICE]
    return token


class WandbBackend:
    name = "wandb"

    def __init__(
        self, project: str, entity: str | None, mode: str, run_name: str, folder: Path, start: int
    ):
        self.project, self.entity, self.mode = project, entity, mode
        self.run_name, self.folder, self.start = run_name, folder, start
        self.run: Any = None

    def open(self, run_id: str | None) -> str:
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        run_id = run_id or uuid.uuid4().hex[:16]  # the tracker stores one before opening
        if (inherited := drop_inherited_wandb_service()) is not None:
            log.info("tracker wandb: not using the W&B service of a parent (%s)", inherited)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=str(self.folder),
            settings=wandb.Settings(
                silent=True,
                console="off",
                init_timeout=60,
                disable_git=True,
                save_code=False,
                x_disable_stats=True,
                x_disable_machine_info=True,
                x_save_requirements=False,
            ),
        )
        return run_id

    def params_(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, Any], when: float) -> None:
        if step <= self.start:
            return  # W&B's steps only grow; these came from an earlier attempt
        self.run.log(_scalars(values), step=step)

    def tag(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def event(self, step: int, name: str, fields: dict[str, Any], when: float) -> None:
        self.run.summary[f"event/{name}"] = {**fields, "time": when}

    def table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """A wandb.Table at the step (its media file in the run folder, its rows in the
        UI); a step from before this attempt's start is skipped, as for metrics."""
        import wandb

        if step <= self.start:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = [[r.get(c) for c in columns] for r in rows]
        self.run.log({name: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)
            self.run = None


def now() -> float:
    return time.time()
