"""`raylift eval` over a run's exports: a row per export in step order (an adapter run's
merged folder preferred), only the chosen steps when asked, a markdown and a JSON table
and a plot of score against step; a target with nothing to score is one line."""

from __future__ import annotations

import json
import shutil

from tests.support.eval_tasks import MC, write_model_and_tasks
from tools.cli import main


def test_eval_scores_each_export_of_a_run_by_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    first, specs = write_model_and_tasks(tmp_path / "a", seed=5)
    second, _ = write_model_and_tasks(tmp_path / "b", seed=9)  # other weights, same tokenizer
    run = tmp_path / "runs" / "r1"
    shutil.copytree(second, run / "export" / "step_00000004" / "model_merged")
    shutil.copytree(first, run / "export" / "step_00000002" / "model")
    (run / "export" / "step_00000004" / "adapter").mkdir()  # not a model: skipped
    mc = specs[0]

    assert main(["eval", str(run), "--tasks", mc, "--batch-size", "4"]) == 0
    rows = json.loads((run / "eval" / "eval.json").read_text())
    assert [(r["step"], r["model"].rsplit("/", 1)[1]) for r in rows] == [
        (2, "model"),
        (4, "model_merged"),
    ]
    key = f"eval/{MC}/acc"
    assert all(0.0 <= r[key] <= 1.0 for r in rows)
    assert rows[0][f"eval/{MC}/acc_norm"] is not None
    md = (run / "eval" / "eval.md").read_text().splitlines()
    assert md[0] == "| step | model | raylift_tiny_mc/acc | raylift_tiny_mc/acc_norm |"
    assert [line.split(" | ")[0] for line in md[2:]] == ["| 2", "| 4"]
    assert md[2].split(" | ")[2] == f"{rows[0][key]:.4f}"
    assert (run / "eval" / "eval.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert f"scoring {run}/export/step_00000002/model (step 2)" in printed
    assert "\n".join(md) in printed  # the table, printed as written

    # One step only, or one export folder (its step read from its path): the same score.
    out = tmp_path / "one"
    assert main(["eval", str(run), "--tasks", mc, "--steps", "2", "--out", str(out)]) == 0
    assert json.loads((out / "eval.json").read_text())[0][key] == rows[0][key]
    folder = run / "export" / "step_00000002" / "model"
    assert main(["eval", str(folder), "--tasks", mc, "--out", str(out)]) == 0
    assert [r["step"] for r in json.loads((out / "eval.json").read_text())] == [2]


def test_a_target_without_a_model_is_one_line(tmp_path, capsys):
    yaml = tmp_path / "t.yaml"
    yaml.write_text("task: t\n")
    assert main(["eval", str(tmp_path / "nothing"), "--tasks", str(yaml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no model to score" in err and err.count("\n") == 1
