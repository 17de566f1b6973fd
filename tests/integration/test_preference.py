"""Preference tuning through the production path: one Ray job, 2 workers, DPO on the tiny
Llama with its reference log-probs precomputed before step 1, on a synthetic set the model
can learn (the chosen answer states "The answer is N.", the rejected one hedges), in
Anthropic HH-RLHF's text shape (the prompt implicit in both answers) and, a fifth of it,
UltraFeedback's (a string prompt, the answers conversations under a chat template).

The job is killed twice: once in the reference pass (the group restarts and runs the pass
again) and once in training between checkpoints (it reads the stored reference back
instead of running the pass again, resumes from the checkpoint, and retrains the lost steps
to the same losses). Then the export,
a plain Hugging Face folder, is scored on held-out pairs against the base model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.jobs import write_job
from tests.support.preference import write_pairs
from tests.support.ray_jobs import history, retrained, run_to_end
from tests.unit.data.test_shapes import TEMPLATE
from trainer.data.tokenize import Settings, prepare
from trainer.objectives.losses import sequence_logps
from trainer.objectives.pairs import PairBlocks, data_options
from trainer.resilience import journal
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow

BLOCK = 40


def _held_out_accuracy(cfg, tiny, export: Path, pairs_file: Path, tmp: Path) -> float:
    """rewards/accuracies of the export against the base model on pairs it never saw."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["model"]))
    opts = data_options(cfg, Settings(block_size=BLOCK))
    cache = prepare(str(pairs_file), tok, cache_root=str(tmp / "held"), progress=False, **opts)
    pairs = PairBlocks(cache, BLOCK)
    ids, labels, _ = pairs.gather(np.arange(len(pairs)))
    x, y = torch.from_numpy(ids), torch.from_numpy(labels)
    out = []
    for folder in (export, tiny["model"]):
        model = AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
        with torch.no_grad():
            out.append(sequence_logps(model(input_ids=x).logits, y)[0])
    ratio = out[0] - out[1]
    n = len(pairs)
    return float((ratio[:n] > ratio[n:]).float().mean())


def _ultrafeedback(path: Path, rows: int) -> Path:
    """UltraFeedback-binarized's shape: a string prompt, and chosen/rejected as whole
    conversations that repeat it as their user turn."""
    chat = write_pairs(path.with_suffix(".chat"), rows, seed=2, chat=True).read_text()
    with open(path, "w") as f:
        for row in map(json.loads, chat.splitlines()):
            (user,) = row["prompt"]
            f.write(
                json.dumps(
                    {
                        "prompt": user["content"],
                        "chosen": [user, *row["chosen"]],
                        "rejected": [user, *row["rejected"]],
                    }
                )
                + "\n"
            )
    path.with_suffix(".chat").unlink()
    return path


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_dpo_learns_preferences_and_survives_kills(ray_cluster, tiny, tmp_path):
    # One source, two files: HH-RLHF text rows and UltraFeedback rows (rendered by a chat
    # template), 320 pairs in all.
    train = tmp_path / "pairs"
    write_pairs(train / "hh.jsonl", 256, seed=1, shape="hh")
    _ultrafeedback(train / "uf.jsonl", 64)
    held = write_pairs(tmp_path / "held.jsonl", 64, seed=99, shape="hh")
    path = write_job(
        tiny,
        tmp_path,
        "dpo",
        model={"special_tokens": None},
        data={
            "train_file": str(train),
            "eval_file": None,
            "block_size": BLOCK,
            "chat_template": TEMPLATE,
        },
        train={
            "objective": "dpo",
            "micro_batch_size": 4,
            "max_steps": 24,
            "eval_every": None,
            "eval_blocks": None,
        },
        checkpoint={"every_steps": 8, "keep_last": 2, "upload": "sync"},
    )
    env = {"RAYLIFT_FAULT_KILL_IN_REFERENCE": "5", "RAYLIFT_FAULT_KILL_AFTER_STEP": "11"}
    cfg, _, logs = run_to_end(ray_cluster, path, env=env)
    assert "hh.jsonl: pairs read as implicit prompt (HH-RLHF) (256)" in logs
    assert (
        "uf.jsonl: pairs read as string prompt, conversational answers (UltraFeedback) (64)" in logs
    )
    assert "killing rank 1 in the reference pass" in logs
    # Attempt 1 died in the pass, attempt 2 ran it, attempt 3 (the resume) read the file.
    assert logs.count("reference pass: 320 pairs in") == 1, logs[-4000:]
    assert logs.count("reference log-probs of 320 pairs from") == 2
    records, steps, _ = history(cfg)
    # Before the first update the policy is the reference: every reward is 0.
    first = next(r for r in records if r.get("step") == 1 and "loss" in r)
    assert first["rewards/margins"] == 0 and first["loss"] == pytest.approx(np.log(2), rel=1e-6)
    # The training kill: steps 9-11 trained twice, from the step-8 checkpoint and the
    # stored reference, to the same losses.
    for a, b in retrained(records, [9, 10, 11]):
        assert a == b
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert steps[-1]["rewards/accuracies"] >= 0.9
    attempts = [
        e
        for e in journal.read(resolve(cfg.storage.path).join(cfg.run.name))
        if e["event"] == "attempt"
    ]
    assert len(attempts) == 2  # the reference-pass kill died before any attempt was journaled
    export = Path(cfg.storage.path) / cfg.run.name / "export" / "step_00000024" / "model"
    assert _held_out_accuracy(cfg, tiny, export, held, tmp_path) >= 0.9
