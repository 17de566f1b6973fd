"""Document attention: a packed block computes exactly what its documents compute run one
by one (logits and loss), and the token cache knows where every document starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.data import TEMPLATE, write
from tests.support.small_model import tiny_llama
from trainer.config import ConfigError, load_config
from trainer.data import packing
from trainer.data.blocks import PackedBlocks
from trainer.data.tokenize import IGNORE, Settings, prepare
from trainer.model.loading import load_tokenizer

LENGTHS = (7, 12, 9)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, vocab=97).eval()


def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]


def _packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat(docs)[None]
    segs = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    labels = ids.clone()
    labels[0, np.cumsum(LENGTHS)[:-1]] = IGNORE  # a document's first token: no target
    return ids, segs, labels


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_block_equals_each_document_alone(model, impl):
    """Logits and loss of three documents packed into one row, with document attention,
    equal those of each document run alone (fp32, ≤ 1e-5); plain causal attention and
    restarted positions alone both differ."""
    model.config._attn_implementation = impl
    docs = _docs()
    ids, segs, labels = _packed(docs)
    with torch.no_grad():
        alone = [model(input_ids=d[None]).logits[0] for d in docs]
        ref_logits = torch.cat(alone)
        # Each document's loss as a sum over its own targets, then the mean over all.
        nll = sum(
            torch.nn.functional.cross_entropy(lg[:-1], d[1:], reduction="sum")
            for lg, d in zip(alone, docs, strict=True)
        )
        ref_loss = nll / sum(n - 1 for n in LENGTHS)

        out = model(input_ids=ids, labels=labels, **packing.attention_inputs(segs, impl))
        assert (out.logits[0] - ref_logits).abs().max() <= 1e-5
        assert abs(float(out.loss) - float(ref_loss)) <= 1e-5

        causal = model(input_ids=ids).logits[0]
        assert (causal - ref_logits).abs().max() > 1e-2
        positions_only = model(input_ids=ids, position_ids=packing.position_ids(segs)).logits[0]
        assert (positions_only - ref_logits).abs().max() > 1e-2


def test_eager_needs_the_additive_mask(model):
    """The fact that decides the mask's type: a bool mask under eager is silently wrong."""
    model.config._attn_implementation = "eager"
    docs = _docs()
    ids, segs, _ = _packed(docs)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        wrong = model(
            input_ids=ids,
            attention_mask=packing.block_causal_mask(segs, "sdpa", torch.float32),
            position_ids=packing.position_ids(segs),
        ).logits[0]
    assert (wrong - ref).abs().max() > 1e-2


def test_positions_restart_per_document():
    segs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 2]])
    assert packing.position_ids(segs).tolist() == [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        [0, 0, 1, 2, 3, 4, 5, 6, 0],
    ]
    assert packing.mask_bytes(4, 2048, "sdpa") == 4 * 2048 * 2048
    assert packing.mask_bytes(4, 2048, "eager") == 16 * 2048 * 2048


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny["model"], str(tiny["tokens"]))


def test_cache_segments_follow_rows_and_long_rows_restart(tmp_path, tokenizer):
    """Segments change exactly where rows end (the rows' own token counts); a row's first
    token is not a target; a row split across blocks restarts at 0 in the next block."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " * (1 + i % 5)},
                {"role": "assistant", "content": f"answer {i} " * (1 + i % 7)},
            ]
        }
        for i in range(40)
    ]
    data = write(tmp_path / "chat.jsonl", rows)
    settings = Settings(chat_template=TEMPLATE, block_size=16, loss_on="all")
    cache = prepare(data, tokenizer, progress=False, settings=settings)
    assert cache.meta["chat_documents"] == 40
    alone = [
        prepare(write(tmp_path / f"r{i}.jsonl", [r]), tokenizer, progress=False, settings=settings)
        for i, r in enumerate(rows[:6])
    ]
    lengths = [c.meta["num_tokens"] for c in alone]
    assert any(n > 16 for n in lengths)  # some rows are split across blocks

    blocks = PackedBlocks(cache, 16, documents=True)
    ids, labels, segs = blocks.gather(np.arange(len(blocks)))
    flat_segs = (segs + np.arange(len(blocks))[:, None] * 1000).reshape(-1)
    starts = np.flatnonzero(np.diff(flat_segs)) + 1
    ends = np.cumsum(lengths)
    block_starts = np.arange(16, int(ends[-1]), 16)
    expected = np.union1d(ends[:-1], block_starts)
    assert starts[starts < ends[-1]].tolist() == expected[expected < ends[-1]].tolist()
    assert all(s[0] == 0 for s in segs)
    # Every token is in the loss (loss_on: all) but a row's first inside a block.
    causal_ids, causal_labels = PackedBlocks(cache, 16).gather(np.arange(len(blocks)))
    assert (causal_ids == ids).all() and (causal_labels == ids).all()
    inside = np.zeros_like(segs, dtype=bool)
    inside[:, 1:] = segs[:, 1:] != segs[:, :-1]
    assert inside.any() and ((labels == IGNORE) == inside).all()
    assert (labels[~inside] == ids[~inside]).all()


def _job(tmp_path: Path, **data) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        json.dumps(
            {
                "model": {"path": str(tmp_path)},
                "data": {"train_file": str(tmp_path / "t.jsonl"), **data},
                "train": {"max_steps": 2, "micro_batch_size": 2},
                "strategy": {"name": "fsdp", "pp": 2},
                "scaling": {"num_workers": 2},
                "storage": {"path": str(tmp_path / "runs")},
                "run": {"name": "pp"},
            }
        )
    )
    return path


def test_document_attention_refused_with_pipeline_stages(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_job(tmp_path, attention="document"), [])
    line = str(err.value)
    assert "\n" not in line and "data.attention" in line and "pp" in line
    assert load_config(_job(tmp_path, attention="auto"), []).data.attention == "auto"
