"""Document attention through the whole loop: a job on packed chat rows trains the same
per-step losses as the same rows run unpacked and padded, one document per row (the same
tokens in the loss), and stops and resumes exactly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.data import TEMPLATE, write
from tests.support.torchrun import torchrun
from trainer.config import load_config
from trainer.data.blocks import BatchPlan, PackedBlocks
from trainer.data.tokenize import IGNORE, TokenCache
from trainer.model.loading import load_model, load_tokenizer
from trainer.observability.metrics import lineage, read_records
from trainer.strategies.common import build_optimizer

pytestmark = pytest.mark.slow

STEPS = 4


def chat_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 9)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return rows


def padded_loss(model: torch.nn.Module, ids: np.ndarray, labels: np.ndarray, segs: np.ndarray):
    """The global batch's mean loss with every document of every block in a row of its own,
    right-padded: the loss the packed block must reproduce."""
    docs = []
    for row in range(len(ids)):
        for s in np.unique(segs[row]):
            keep = segs[row] == s
            docs.append((ids[row][keep], labels[row][keep]))
    width = max(len(d) for d, _ in docs)
    x = torch.zeros((len(docs), width), dtype=torch.long)
    y = torch.full((len(docs), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for i, (d, lab) in enumerate(docs):
        x[i, : len(d)] = torch.from_numpy(d)
        y[i, : len(d)] = torch.from_numpy(lab)
        y[i, 0] = IGNORE
        mask[i, : len(d)] = 1
    logits = model(input_ids=x, attention_mask=mask).logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        y[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return nll / (y[:, 1:] != IGNORE).sum()


def test_document_attention_loop_matches_unpacked_and_resumes(job, tiny, tmp_path):
    data = write(tmp_path / "chat.jsonl", chat_rows(400, seed=5))
    path = job(
        "docattn",
        data={"train_file": str(data), "eval_file": None, "chat_template": TEMPLATE},
        train={"max_steps": STEPS, "stop_at_step": 2, "eval_every": 100},
        optim={"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "grad_clip": None},
        scaling={"num_workers": 1},
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    first = torchrun(["-m", "trainer", "run", str(path)], nproc=1, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "document attention" in first.stderr
    again = torchrun(
        ["-m", "trainer", "run", str(path), "--set", "train.stop_at_step=null"],
        nproc=1,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    records = read_records_at(tmp_path / "runs" / "docattn")
    steps, _ = lineage(records)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert any(r.get("event") == "resume" for r in records)

    # The same steps in this process, one document per padded row.
    cfg = load_config(path, [])
    (cache_dir,) = {p.parent for p in (data.parent / ".raylift-cache").glob("*/manifest.json")}
    blocks = PackedBlocks(TokenCache(cache_dir), cfg.data.block_size, documents=True)
    plan = BatchPlan(len(blocks), cfg.train.micro_batch_size, 1, 1, cfg.train.seed)
    tok = load_tokenizer(tiny["model"], cfg.model.special_tokens)
    torch.manual_seed(cfg.train.seed)
    model = load_model(Path(cfg.model.path), cfg, len(tok))
    model.train()
    opt = build_optimizer(cfg, model)
    expected = []
    for step in range(STEPS):
        (ix,) = plan.step_indices(step, 0)
        loss = padded_loss(model, *blocks.gather(ix))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    got = [r["loss"] for r in steps]
    assert np.allclose(got, expected, rtol=0, atol=1e-5), (got, expected)


def read_records_at(run: Path) -> list[dict]:
    from trainer.storage.location import resolve

    return read_records(resolve(str(run.parent)).join(run.name, "metrics.jsonl"))


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_mixed_sources_resume_exactly_and_report_per_source(job, tiny, tmp_path):
    """Two sources mixed 3:1 (plain rows and chat rows: document attention by default):
    stopped at step 3 and resumed, the run repeats the uninterrupted run's losses; tokens
    seen and eval loss are reported per source."""
    chat = write(tmp_path / "chat.jsonl", chat_rows(300, seed=9))
    chat_eval = write(tmp_path / "chat-eval.jsonl", chat_rows(40, seed=10))
    data = {
        "train_file": [
            {"path": str(tiny["train"]), "weight": 3, "name": "qa"},
            {"path": str(chat), "name": "chat"},
        ],
        "eval_file": [{"path": str(tiny["eval"]), "name": "qa"}, {"path": str(chat_eval)}],
        "chat_template": TEMPLATE,
    }
    common = {"max_steps": 6, "eval_every": 3, "eval_blocks": 8}
    straight = job("mix-straight", data=data, train=common, scaling={"num_workers": 1})
    res = torchrun(["-m", "trainer", "run", str(straight)], nproc=1, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "document attention" in res.stderr
    resumed = job(
        "mix-resumed",
        data=data,
        train={**common, "stop_at_step": 3},
        scaling={"num_workers": 1},
        checkpoint={"every_steps": 3},
    )
    for extra in ([], ["--set", "train.stop_at_step=null"]):
        res = torchrun(["-m", "trainer", "run", str(resumed), *extra], nproc=1, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    a, _ = lineage(read_records_at(tmp_path / "runs" / "mix-straight"))
    b, _ = lineage(read_records_at(tmp_path / "runs" / "mix-resumed"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    assert np.allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=0, atol=1e-6)
    last = a[-1]
    qa, ch = last["tokens_seen/qa"], last["tokens_seen/chat"]
    assert qa + ch == last["tokens_seen"] and qa > ch > 0
    assert b[-1]["tokens_seen/chat"] == ch
    assert {"eval_loss", "eval_loss/qa", "eval_loss/chat-eval"} <= set(last)
    lo, hi = sorted([last["eval_loss/qa"], last["eval_loss/chat-eval"]])
    assert lo <= last["eval_loss"] <= hi
