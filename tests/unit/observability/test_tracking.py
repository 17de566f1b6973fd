"""Trackers with their real clients, no network: MLflow on a sqlite store, W&B offline
(its own files read back with its own reader), TensorBoard event files read back from
their protobuf records. A run continues the same tracker run across attempts, a step
rolled back by a restart is not logged twice, and an unreachable tracker never blocks."""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.trackers import tb_events, wandb_history
from trainer.config import JobConfig, load_config
from trainer.errors import ConfigError
from trainer.observability.tracking.sender import Sender
from trainer.observability.tracking.trackers import (
    STATE_FILE,
    Tracker,
    flat_config,
    flatten,
    open_tracker,
    read_state,
)
from trainer.storage.location import resolve


def _cfg(tmp_path: Path, **tracking: Any) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train_file": "t.jsonl"},
            "storage": {"path": str(tmp_path / "runs")},
            "run": {"name": "watch"},
            "scaling": {"num_workers": 1},
            "tracking": tracking,
        }
    )


def _record(step: int, attempt: int, loss: float | None = None) -> dict[str, Any]:
    return {
        "event": "train",
        "attempt": attempt,
        "step": step,
        "time": 1_700_000_000.0 + step + 1000 * attempt,  # a retrained step is later
        "loss": 10.0 - step if loss is None else loss,
        "tokens_per_s": 100.0 * attempt,
        "mem_peak_gib_max": 1.5,
        "mem_peak_gib_max_rank": 1,
        "per_rank": {"mem_peak_gib": [1.0, 1.5]},
    }


def _journal(attempts: int) -> list[dict[str, Any]]:
    """The run journal as each attempt reads it: every attempt so far."""
    return [
        {"time": 5.0 + a, "event": "attempt", "source": f"attempt-{a}", "attempt": a}
        for a in range(1, attempts + 1)
    ]


def _attempt(cfg, run, attempt, start, steps, history=(), status="finished"):
    t = Tracker(cfg, run, attempt, start, list(history))
    for s in steps:
        t.metrics(_record(s, attempt))
    for sender in t.senders.values():  # a run lives longer than a tracker takes to open
        assert sender.drain(600), sender.failing
    t.tag("raylift.export", f"{run.uri}/export/step_{steps[-1]:08d}")
    t.events(_journal(attempt))
    out = t.close(status)
    assert all(o.unsent == 0 and o.dropped == 0 for o in out), out
    return t


def test_config_section_and_shorthand(tmp_path):
    cfg = _cfg(tmp_path, tensorboard=True, wandb={"project": "p", "mode": "offline"})
    assert cfg.tracking.trackers == ["wandb", "tensorboard"]
    assert _cfg(tmp_path, tensorboard=False).tracking.trackers == []
    path = tmp_path / "job.yaml"
    path.write_text(
        "model: {path: m}\ndata: {train_file: t.jsonl}\nrun: {name: r}\n"
        "tracking:\n  mlflow: {experiment: x}\n"
    )
    with pytest.raises(ConfigError, match=r"job.yaml:5: tracking.mlflow.tracking_uri: required"):
        load_config(path)


def test_config_is_logged_without_secrets(tmp_path):
    cfg = _cfg(tmp_path, mlflow={"tracking_uri": "https://bob:hunter2@mlflow.example:5000"})
    flat = flat_config(cfg)
    assert flat["run.name"] == "watch" and flat["train.seed"] == "42"
    assert flat["tracking.mlflow.tracking_uri"] == "https://***@mlflow.example:5000"
    assert not any("hunter2" in v for v in flat.values())
    nested = {"hub": {"hf_token": "hf_abc", "api_key": "k", "tokenizer": "t"}, "n": [1, 2]}
    assert flatten(nested) == {
        "hub.hf_token": "***",
        "hub.api_key": "***",
        "hub.tokenizer": "t",
        "n": "[1, 2]",
    }


def test_mlflow_one_run_across_attempts_each_step_once(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _cfg(tmp_path, mlflow={"tracking_uri": uri, "experiment": "exp"})
    run = resolve(cfg.storage.path).join("watch")
    # Attempt 1 trains 1..5 and dies; the checkpoint was 3, so 4 and 5 are rolled back.
    _attempt(cfg, run, 1, 0, range(1, 6), status="failed")
    first_id = read_state(run)["mlflow"]
    history = [_record(s, 1) for s in range(1, 4)]
    _attempt(cfg, run, 2, 3, range(4, 9), history)
    assert read_state(run)["mlflow"] == first_id

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("exp")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [first_id]
    r = runs[0]
    assert r.info.run_name == "watch" and r.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(first_id, "loss")]
    assert sorted(steps) == list(range(1, 9)), steps  # 4 and 5 once, not twice
    assert {m.step for m in client.get_metric_history(first_id, "rank1.mem_peak_gib")} == set(
        range(1, 9)
    )
    assert r.data.params["run.name"] == "watch" and r.data.params["train.seed"] == "42"
    assert r.data.tags["raylift.export"].endswith("/export/step_00000008")
    assert any(k.startswith("raylift.event.") for k in r.data.tags)


def test_mlflow_outage_resends_missed_points_next_attempt(tmp_path):
    """The store is unreachable for all of attempt 1 (a file stands where its folder
    goes): training goes on, the end says how many points were not sent; attempt 2 sends
    them from the metrics history."""
    from mlflow.tracking import MlflowClient

    db = tmp_path / "later" / "mlflow.db"
    db.parent.write_text("not a folder")
    cfg = _cfg(tmp_path, mlflow={"tracking_uri": f"sqlite:///{db}"}, close_timeout_s=2)
    run = resolve(cfg.storage.path).join("watch")
    t = Tracker(cfg, run, 1, 0, [])
    started = time.monotonic()
    for s in range(1, 5):
        t.metrics(_record(s, 1))
    t.events(_journal(1))
    assert time.monotonic() - started < 1.0  # queueing never waits on the tracker
    started = time.monotonic()
    (out,) = t.close("stopped")  # tracking.close_timeout_s: 2
    assert 2.0 <= time.monotonic() - started < 10.0
    assert out.unsent >= 4 and out.error and "mlflow" not in read_state(run)

    db.parent.unlink()
    db.parent.mkdir()
    history = [_record(s, 1) for s in range(1, 5)]
    _attempt(cfg, run, 2, 4, range(5, 7), history)
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run_id = read_state(run)["mlflow"]
    steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert sorted(steps) == list(range(1, 7))
    # Attempt 1's journal event too: the tracker never took it then.
    tags = client.get_run(run_id).data.tags
    events = sorted(json.loads(v)["attempt"] for k, v in tags.items() if "raylift.event." in k)
    assert events == [1, 2]


def test_wandb_offline_same_run_id_and_steps(tmp_path):
    cfg = _cfg(tmp_path, wandb={"project": "proj", "mode": "offline"})
    run = resolve(cfg.storage.path).join("watch")
    _attempt(cfg, run, 1, 0, range(1, 6), status="failed")
    run_id = read_state(run)["wandb"]
    # W&B names an offline run's folder by the (local) second it opened: a real restart
    # takes far longer than that, these two in-process attempts may not (same folder).
    # Attempt 2 opens once the clock has left the second in attempt 1's folder name.
    (opened_folder,) = Path(run.path, "wandb").glob(f"offline-run-*-{run_id}")
    opened = opened_folder.name.split("-")[2]  # offline-run-<YYYYmmdd_HHMMSS>-<id>
    deadline = time.monotonic() + 30
    while datetime.datetime.now().strftime("%Y%m%d_%H%M%S") == opened:
        assert time.monotonic() < deadline, f"the clock stayed in {opened}"
        time.sleep(0.02)
    _attempt(cfg, run, 2, 3, range(4, 7), [_record(s, 1) for s in range(1, 4)])
    assert read_state(run)["wandb"] == run_id
    folders = sorted(Path(run.path, "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2, folders  # offline W&B ignores resume: one folder per attempt
    first, second = (wandb_history(f) for f in folders)
    assert [int(r["_step"]) for r in first] == [1, 2, 3, 4, 5]
    assert [int(r["_step"]) for r in second] == [4, 5, 6]
    assert second[0]["tokens_per_s"] == 200.0 and second[0]["rank1/mem_peak_gib"] == 1.5


def test_a_restarted_rank_zero_opens_its_run_in_a_service_of_its_own(tmp_path):
    """A process that used W&B leaves its service's token in the environment, and its
    children inherit it (in CI a Ray cluster started by the pytest process did, so every
    worker shared the test process's W&B service). A rank 0 killed with the run open
    leaves the run's stream in that service, and the restarted rank 0 then failed to
    open the run ("run ID ... is in use") and sent W&B nothing. Here the parent holds
    the run open as the killed rank did; the child, a new rank 0, must still open it."""
    import os
    import subprocess
    import sys

    import wandb

    run_id = "restartedrank0x"
    parent = wandb.init(
        project="proj",
        mode="offline",
        id=run_id,
        dir=str(tmp_path),
        settings=wandb.Settings(silent=True, console="off", disable_git=True),
    )
    try:
        assert os.environ.get("WANDB_SERVICE")  # what a child inherits
        code = (
            "import sys; from pathlib import Path; "
            "from trainer.observability.tracking.backends import WandbBackend; "
            "b = WandbBackend('proj', None, 'offline', 'r', Path(sys.argv[1]), 0); "
            "b.open(sys.argv[2]); b.metrics(1, {'loss': 1.0}, 0.0); b.close('finished'); "
            "print('opened')"
        )
        res = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "child"), run_id],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0 and "opened" in res.stdout, res.stderr[-2000:]
    finally:
        parent.finish()
    (folder,) = (tmp_path / "child" / "wandb").glob(f"offline-run-*-{run_id}")
    assert [int(r["_step"]) for r in wandb_history(folder)] == [1]


def test_tensorboard_event_files_and_purge_on_resume(tmp_path):
    cfg = _cfg(tmp_path, tensorboard=True)
    run = resolve(cfg.storage.path).join("watch")
    _attempt(cfg, run, 1, 0, range(1, 6), status="failed")
    _attempt(cfg, run, 2, 3, range(4, 7), [_record(s, 1) for s in range(1, 4)])
    files = tb_events(Path(run.path, "tensorboard"))
    assert len(files) == 2 and all(".attempt-" in n for n in files)
    first = next(v for k, v in files.items() if k.endswith(".attempt-1"))
    second = next(v for k, v in files.items() if k.endswith(".attempt-2"))

    def scalars(events, tag):
        return [(e.step, v.simple_value) for e in events for v in e.summary.value if v.tag == tag]

    assert [s for s, _ in scalars(first, "loss")] == [1, 2, 3, 4, 5]
    assert scalars(second, "loss") == [(4, 6.0), (5, 5.0), (6, 4.0)]
    assert [s for s, _ in scalars(second, "rank1/mem_peak_gib")] == [4, 5, 6]
    # TensorBoard drops the lost attempt's points from the purge step on: a SessionLog
    # START at step 4 opens attempt 2's file.
    starts = [e for e in second if e.HasField("session_log")]
    assert starts and starts[0].step == 4 and starts[0].session_log.status == 1


def test_sender_retries_in_background_and_bounds_its_buffer():
    calls: list[int] = []
    gate = threading.Event()

    def flaky(i: int):
        def call():
            if not gate.is_set():
                raise ConnectionError("tracker down")
            calls.append(i)

        return call

    s = Sender("t", limit=100, max_backoff_s=0.05)
    s.put("open", flaky(-1))
    for i in range(150):
        s.put("metrics", flaky(i))
    deadline = time.monotonic() + 60
    while s.failing is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.failing and "tracker down" in s.failing
    assert s.dropped == 51  # the oldest points; never the item that opens the run
    gate.set()
    out = s.close(timeout_s=60)
    assert out.unsent == 0 and out.dropped == 51 and out.error is None
    assert calls == [-1, *range(51, 150)]


def test_batch_sender_sends_records_several_to_a_call_in_order_and_retries_a_batch():
    calls: list[object] = []
    down = threading.Event()

    def batch(payloads):
        if down.is_set():
            down.clear()
            raise ConnectionError("store busy")
        calls.append(list(payloads))

    s = Sender("t", max_backoff_s=0.05, batch=batch, linger_s=600, max_batch=3)
    s.put("open", lambda: calls.append("open"))
    for i in range(4):  # three fill a batch; the fourth lingers for company
        s.put("metrics", None, payload=i)
    s.put("tag", lambda: calls.append("tag"))  # a plain item ends a run of records
    down.set()  # the first batch fails once and is sent again, whole
    s.put("metrics", None, payload=4)
    assert s.drain(60)  # a drain sends what lingers at once
    assert calls == ["open", [0, 1, 2], [3], "tag", [4]]
    assert s.sent == 7 and s.failing is None
    with pytest.raises(ValueError):
        s.put("metrics", lambda: None, payload=5)  # a call or a payload, not both
    s.close(timeout_s=10)


def test_batch_sender_sends_a_lone_record_once_it_has_lingered():
    got: list[list[int]] = []
    sent = threading.Event()

    def batch(payloads: list[int]) -> None:
        got.append(payloads)
        sent.set()

    s = Sender("t", batch=batch, linger_s=1.0, max_batch=16)
    t0 = time.monotonic()
    s.put("metrics", None, payload=1)
    assert not sent.is_set()  # waiting for company
    assert sent.wait(60)
    assert got == [[1]] and time.monotonic() - t0 >= 0.95
    s.close(timeout_s=10)


def test_no_tracker_for_other_ranks_or_smoke_runs(tmp_path):
    cfg = _cfg(tmp_path, tensorboard=True)
    run = resolve(cfg.storage.path).join("watch")
    assert open_tracker(cfg, run, 1, 1, 0, []).names == ()
    smoke = cfg.model_copy(update={"train": cfg.train.model_copy(update={"as_test": True})})
    assert open_tracker(smoke, run, 0, 1, 0, []).names == ()
    assert not Path(run.path, STATE_FILE).exists()


def test_preflight_names_a_missing_tracker_client(tmp_path, monkeypatch):
    from trainer import preflight
    from trainer.errors import UserError

    monkeypatch.setitem(preflight.TRACKER_PACKAGES, "wandb", "wandb_not_installed_here")
    cfg = _cfg(tmp_path, wandb={"project": "p"}, tensorboard=True)
    with pytest.raises(UserError) as err:
        preflight.check_tracking(cfg, True, preflight.Report())
    assert str(err.value) == (
        "tracking.wandb: the wandb_not_installed_here package is not installed here; install "
        "the trackers with pip install 'raylift[track]' (or remove tracking.wandb)"
    )
    report = preflight.Report()
    preflight.check_tracking(cfg, False, report)  # a laptop: the image is what counts
    assert len(report.notes) == 1 and report.notes[0].endswith("checked again on the cluster")


def _half_made_mlflow_db(path: Path) -> None:
    """What a rank killed during MLflow's first-use migrations leaves: the initial tables
    and some later ones, with no record of the migrations that made them."""
    import sqlalchemy
    from mlflow.store.db.base_sql_model import Base

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    Base.metadata.tables["experiments"].create(engine)
    Base.metadata.tables["assessments"].create(engine)
    engine.dispose()


def test_driver_makes_the_mlflow_store_whole_and_refuses_a_half_made_one(tmp_path):
    """The driver creates a sqlite store before any worker starts (a rank killed while
    MLflow migrates leaves a database nobody can open again); one left half made by
    an earlier kill is refused in one line before the job starts."""
    import mlflow.store.db.utils as dbutils
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    from trainer import preflight
    from trainer.errors import UserError

    db = tmp_path / "track" / "mlflow.db"
    cfg = _cfg(tmp_path, mlflow={"tracking_uri": f"sqlite:///{db}", "experiment": "e"})
    preflight.check_tracking(cfg, False, preflight.Report())  # a laptop: nothing made
    assert not db.exists()
    preflight.check_tracking(cfg, True, preflight.Report())
    assert dbutils._all_tables_exist(sqlalchemy.create_engine(f"sqlite:///{db}"))
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db"]  # no side file
    preflight.check_tracking(cfg, True, preflight.Report())  # a whole one is kept as is

    bad = tmp_path / "bad.db"
    _half_made_mlflow_db(bad)
    with pytest.raises(Exception, match="OperationalError"):  # MLflow cannot open it
        MlflowClient(tracking_uri=f"sqlite:///{bad}").search_experiments()
    cfg = _cfg(tmp_path, mlflow={"tracking_uri": f"sqlite:///{bad}", "experiment": "e"})
    with pytest.raises(UserError) as err:
        preflight.check_tracking(cfg, True, preflight.Report())
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"tracking.mlflow.tracking_uri sqlite:///{bad}:")
    assert "half made: move it away" in msg


def test_a_kill_while_the_mlflow_store_is_made_leaves_no_database(tmp_path):
    """The schema is made in a side file and linked into place only when whole: a driver
    killed in the middle leaves no database, so the next submission makes a new one."""
    import os
    import signal
    import subprocess
    import sys

    db = tmp_path / "mlflow.db"
    code = (
        "import sys; from trainer.observability.tracking.backends import prepare_mlflow_store; "
        "prepare_mlflow_store(sys.argv[1])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}"])
    side = db.with_name(f".mlflow.db.init-{proc.pid}")
    deadline = time.monotonic() + 300

    def tables_written() -> bool:  # wherever the schema is being made, it has begun
        return any(p.exists() and p.stat().st_size > 0 for p in (side, db))

    while not tables_written():  # MLflow's migrations take seconds; kill in the middle
        assert proc.poll() is None and time.monotonic() < deadline, "no schema seen"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not db.exists()
    from trainer.observability.tracking.backends import prepare_mlflow_store

    prepare_mlflow_store(f"sqlite:///{db}")  # the next driver makes it whole
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
