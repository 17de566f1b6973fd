"""KTO end to end, from the Hub: one Ray job, 2 workers, full fine-tuning of the tiny Llama
named by a Hub id, on unpaired feedback named by an hf://datasets id whose columns are
mapped (question/answer/good), both resolved by the driver through huggingface_hub in
offline mode over a cache in its own layout. The reference log-probs of every row and of
its mismatched (KL) sequence are precomputed before step 1.

The job trains (step 1 is KTO's 0.5: the policy is the reference), its loss falls, the
desirable rows' rewards rise above the undesirable ones', the commit each id resolved to
is in the run's hub.json, and the export loads and prefers the desirable answers on pairs
it never saw."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_preference import _held_out_accuracy
from tests.support.hub import card, commit, model_files
from tests.support.jobs import write_job
from tests.support.preference import write_pairs
from tests.support.ray_jobs import history, run_to_end
from trainer.storage import hub

pytestmark = pytest.mark.slow

BLOCK, MODEL, DATA = 40, "tiny-org/tiny-llama", "tiny-org/feedback"


def _feedback(pairs: Path) -> bytes:
    """Each pair as two unpaired rows, shuffled, under the file's own column names."""
    rows = []
    for line in pairs.read_text().splitlines():
        p = json.loads(line)
        rows.append({"question": p["prompt"], "answer": p["chosen"], "good": True})
        rows.append({"question": p["prompt"], "answer": p["rejected"], "good": False})
    random.Random(3).shuffle(rows)
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_kto_from_hub_ids_learns_the_desirable_answers(ray_cluster, tiny, tmp_path):
    shared = tmp_path / "shared"
    model_rev = commit(shared / "hub", "model", MODEL, model_files(Path(tiny["model"])))
    rows = _feedback(write_pairs(tmp_path / "pairs.jsonl", 96, seed=1))
    files = {"README.md": card({"train": "data/train-*.jsonl"}), "data/train-0.jsonl": rows}
    data_rev = commit(shared / "hub", "dataset", DATA, files)
    held = write_pairs(tmp_path / "held.jsonl", 64, seed=99)
    path = write_job(
        tiny,
        tmp_path,
        "kto",
        model={"path": MODEL, "special_tokens": None},
        data={
            "train_file": f"hf://datasets/{DATA}",
            "eval_file": None,
            "block_size": BLOCK,
            "cache_dir": str(shared),
            "columns": {"prompt": "question", "completion": "answer", "label": "good"},
        },
        train={"objective": "kto", "micro_batch_size": 4, "max_steps": 10, "eval_every": None,
               "eval_blocks": None},
        checkpoint={"every_steps": 10, "keep_last": 1, "upload": "sync"},
    )  # fmt: skip
    cfg, _, logs = run_to_end(ray_cluster, path, env={"HF_HUB_OFFLINE": "1"})
    assert "reference pass: 192 pairs in" in logs  # every row and its KL sequence
    _, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert steps[0]["loss"] == pytest.approx(0.5, rel=1e-6) and steps[0]["kl"] == 0
    late = steps[-3:]  # a run here: 0.5 at steps 1-2, 0.15-0.18 at steps 9-10
    assert np.mean([r["loss"] for r in late]) < 0.35
    assert np.mean([r["rewards/chosen"] - r["rewards/rejected"] for r in late]) > 0
    run = Path(cfg.storage.path) / cfg.run.name
    record = json.loads((run / hub.RECORD).read_text())
    assert record[MODEL]["revision"] == model_rev
    assert record[f"hf://datasets/{DATA}"]["revision"] == data_rev
    export = run / "export" / "step_00000010" / "model"
    pairs_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"objective": "dpo"})})
    assert _held_out_accuracy(pairs_cfg, tiny, export, held, tmp_path) >= 0.75
