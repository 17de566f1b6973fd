"""`raylift eval RUN` as a Ray job over a run's two checkpoints, on the local cluster.

The run is the session's DDP reference (12 steps, checkpoints kept at steps 8 and 12),
copied so its folder stays as the other tests read it. The job loads each checkpoint with
the run's strategy and scores its export with lm-eval; the reference is
`lm_eval.simple_evaluate` here, in the test process, on the same checkpoint's weights put
into the exported model by hand (its model.pt into the HF model)."""

from __future__ import annotations

import json
import shutil

from tests.support.eval_tasks import MC, write_model_and_tasks
from tools.cli import main

TOL = 1e-6


def _reference(run, step: int, spec: str) -> dict[str, float]:
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.evaluation.tasks import evaluate, scores

    folder = run / "export" / "step_00000012" / "model"  # the architecture and tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = torch.load(run / f"step_{step:08d}" / "strategy" / "model.pt", weights_only=True)
    model.load_state_dict(weights)
    tok = AutoTokenizer.from_pretrained(folder)
    lm = HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4)
    return scores(evaluate(lm, [spec]) or {})


def test_eval_job_scores_both_checkpoints_as_lm_eval_does(
    ray_cluster, ddp_reference, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _, specs = write_model_and_tasks(tmp_path / "tasks")
    mc = specs[0]
    run = tmp_path / "ref-ddp"
    shutil.copytree(ddp_reference["run_dir"], run, ignore=shutil.ignore_patterns("eval"))

    argv = ["eval", str(run), "--tasks", mc, "--address", ray_cluster.dashboard_url]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "submitted job raylift-eval-ref-ddp-" in printed

    rows = json.loads((run / "eval" / "eval.json").read_text())
    assert [r["step"] for r in rows] == [8, 12]
    assert [r["model"] for r in rows] == [str(run / "step_00000008"), str(run / "step_00000012")]
    for row in rows:
        want = _reference(run, row["step"], mc)
        assert set(want) == {f"eval/{MC}/acc", f"eval/{MC}/acc_norm"}
        for key, value in want.items():
            assert abs(row[key] - value) < TOL, (row["step"], key, row[key], value)
    md = (run / "eval" / "eval.md").read_text()
    assert md in printed  # the job's log, followed here, ends with the table
    assert (run / "eval" / "eval.png").read_bytes()[:4] == b"\x89PNG"
