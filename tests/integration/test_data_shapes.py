"""The data users bring, end to end: one short Ray job on a mix of four sources, each in a
shape of its own (Alpaca, ShareGPT, OpenAI tool use, and question/answer columns mapped by
data.columns). The run says which shape it read each source as, trains (its loss falls),
and its export loads with plain transformers and scores the answers better than the base
model does."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.support.data import write
from tests.support.jobs import write_job
from tests.support.ray_jobs import history, run_to_end
from tests.unit.data.test_shapes import TEMPLATE, TOOLS

pytestmark = pytest.mark.slow

STEPS = 16


def _sums(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 9)
        out.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    return out


def _sources(folder: Path) -> list[dict]:
    alpaca = [
        {"instruction": "Add the numbers.", "input": q, "output": a} for q, a in _sums(120, 1)
    ]
    sharegpt = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in _sums(120, 2)
    ]
    tools = []
    for q, a in _sums(120, 3):
        call = {"type": "function", "function": {"name": "add", "arguments": {"q": q}}}
        tools.append(
            {
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "content": a.split()[-1]},
                    {"role": "assistant", "content": a},
                ],
                "tools": TOOLS,
            }
        )
    qa = [{"question": q, "answer": a, "source": "synthetic"} for q, a in _sums(120, 4)]
    return [
        {"path": str(write(folder / "alpaca.jsonl", alpaca))},
        {"path": str(write(folder / "sharegpt.jsonl", sharegpt))},
        {"path": str(write(folder / "tools.jsonl", tools))},
        {
            "path": str(write(folder / "qa.jsonl", qa)),
            "columns": {"prompt": "question", "completion": "answer"},
        },
    ]


def _answer_loss(model_dir: Path, tokenizer, rows: list[tuple[str, str]]) -> float:
    """Mean loss of the answers under the chat template, prompts out of the loss."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    losses = []
    for q, a in rows:
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out = tokenizer.apply_chat_template(
            msgs,
            chat_template=TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids = torch.tensor([out["input_ids"]])
        labels = ids.clone()
        labels[0, torch.tensor(out["assistant_masks"]) == 0] = -100
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=labels).loss))
    return float(np.mean(losses))


def test_a_mix_of_shapes_trains_and_exports(ray_cluster, tiny, tmp_path):
    from transformers import AutoTokenizer

    path = write_job(
        tiny,
        tmp_path,
        "shapes",
        model={"special_tokens": None},
        data={
            "train_file": _sources(tmp_path / "data"),
            "eval_file": None,
            "block_size": 64,
            "chat_template": TEMPLATE,
        },
        train={"micro_batch_size": 4, "max_steps": STEPS, "eval_every": None, "eval_blocks": None},
        optim={"lr": 3e-3, "warmup_steps": 0},
        scaling={"num_workers": 1},
        checkpoint={"every_steps": STEPS, "keep_last": 1, "upload": "sync"},
    )
    cfg, _, logs = run_to_end(ray_cluster, path)
    for line in (
        "alpaca.jsonl: 1 files read as alpaca",
        "sharegpt.jsonl: 1 files read as sharegpt",
        "tools.jsonl: 1 files read as tool use",
        "qa.jsonl: 1 files read as prompt/completion (columns {'completion': 'answer', "
        "'prompt': 'question'}); extra fields ignored: source",
    ):
        assert line in logs, logs[-4000:]
    _, steps, _ = history(cfg)
    losses = [r["loss"] for r in steps]
    assert len(losses) == STEPS
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    export = Path(cfg.storage.path) / cfg.run.name / "export" / f"step_{STEPS:08d}" / "model"
    tok = AutoTokenizer.from_pretrained(str(export))
    held = _sums(24, 99)
    assert _answer_loss(export, tok, held) < _answer_loss(tiny["model"], tok, held)
