"""The eval job's command line and what it refuses, without a cluster: task YAMLs and the
run become absolute paths (the job runs in its own working folder), a run folder without
job.json or without a complete checkpoint is one line naming the folder."""

from __future__ import annotations

import argparse
import shlex
from types import SimpleNamespace

import pytest

from tools.evaluate.remote import entrypoint, is_run
from trainer.errors import UserError
from trainer.evaluation.offline import checkpoints, run_config
from trainer.storage.location import resolve


def test_entrypoint_passes_absolute_task_paths_and_the_chosen_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tasks = ["tasks/t.yaml", "arc_easy"]
    args = argparse.Namespace(tasks=tasks, steps=[4, 8], limit=5, batch_size=2)
    words = shlex.split(entrypoint("s3://b/runs/r", args, "http://127.0.0.1:9000", None))
    assert words == [
        "python", "-m", "trainer", "eval", "s3://b/runs/r",
        "--tasks", str(tmp_path / "tasks" / "t.yaml"), "arc_easy",
        "--steps", "4", "8", "--limit", "5", "--batch-size", "2",
        "--endpoint-override", "http://127.0.0.1:9000",
    ]  # fmt: skip


def test_a_folder_that_is_not_a_run_or_has_no_checkpoint_is_one_line(tmp_path):
    assert not is_run(str(tmp_path)) and is_run("s3://b/runs/r")
    with pytest.raises(UserError, match=r"no job\.json: not a Raylift run folder") as e:
        run_config(resolve(str(tmp_path)))
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    run = resolve(str(tmp_path))
    found = [(4, SimpleNamespace(uri="a")), (8, SimpleNamespace(uri="b"))]
    assert [s for s, _ in checkpoints(run, [8], lambda _: found)] == [8]
    with pytest.raises(UserError, match=r"no complete checkpoint at steps \[5\] to score"):
        checkpoints(run, [5], lambda _: found)
