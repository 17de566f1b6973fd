"""RL's sampled completions reach the trackers as tables, through their real clients and
no network: W&B offline (a wandb.Table whose file in the run folder holds the rows) and
MLflow on a sqlite store whose experiment keeps its artifacts in a temporary folder (a
JSON table artifact per logged step; MLflow 3.17's file store refuses new runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.trackers import wandb_history
from trainer.config import JobConfig
from trainer.observability.tracking.trackers import Tracker, read_state
from trainer.storage.location import resolve

ROWS = [
    {
        "step": 2,
        "rank": 0,
        "prompt": f"what is {i} plus {i}?",
        "completion": f"#### {2 * i}",
        "reward": 0.5 * i,
        "reward/math_answer": float(i % 2),
    }
    for i in range(3)
]


def _tracked(tmp_path: Path, again: bool = False, **tracking: Any) -> tuple[JobConfig, Any]:
    cfg = JobConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train_file": "t.jsonl"},
            "storage": {"path": str(tmp_path / "runs")},
            "run": {"name": "rl"},
            "scaling": {"num_workers": 1},
            "tracking": tracking,
        }
    )
    run = resolve(cfg.storage.path).join("rl")
    t = Tracker(cfg, run, 1, 0, [])
    for step in (1, 2):
        t.metrics({"event": "train", "attempt": 1, "step": step, "time": 1e9 + step, "reward": 0.1})
    t.table("completions", 2, ROWS)
    if again:  # step 2 again, as an attempt that retrains it after a restart sends it
        t.table("completions", 2, ROWS[:1])
    for sender in t.senders.values():
        assert sender.drain(120), sender.failing
    out = t.close("finished")
    assert all(o.unsent == 0 and o.dropped == 0 for o in out), out
    return cfg, run


def test_mlflow_gets_a_table_artifact_per_logged_step(tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifacts = (tmp_path / "artifacts").as_uri()
    MlflowClient(tracking_uri=uri).create_experiment("rl", artifact_location=artifacts)
    _, run = _tracked(tmp_path, True, mlflow={"tracking_uri": uri, "experiment": "rl"})
    client = MlflowClient(tracking_uri=uri)
    run_id = read_state(run)["mlflow"]
    (listed,) = client.list_artifacts(run_id, "completions")
    assert listed.path == "completions/step_00000002.json"
    local = client.download_artifacts(run_id, listed.path, str(tmp_path / "got"))
    table = json.loads(Path(local).read_text())
    got = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert got == ROWS  # the first table of a step stays whole, and once


def test_wandb_offline_logs_a_table_with_the_rows(tmp_path) -> None:
    _, run = _tracked(tmp_path, wandb={"project": "proj", "mode": "offline"})
    (folder,) = Path(run.path, "wandb").glob("offline-run-*")
    history = wandb_history(folder)
    (row,) = [h for h in history if "completions/_type" in h]  # W&B flattens the table's keys
    assert int(row["_step"]) == 2 and row["completions/_type"] == "table-file"
    assert row["completions/nrows"] == 3
    table = json.loads((folder / "files" / row["completions/path"]).read_text())
    got = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert got == ROWS
