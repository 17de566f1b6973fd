"""Preference rows into the pair cache: layout, targets, cutting, bad rows (file:line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.preference import write_pairs
from trainer.config import load_config
from trainer.data.tokenize import IGNORE, Settings, prepare
from trainer.errors import DataError
from trainer.objectives.pairs import PairBlocks, cut_pair, data_options
from trainer.objectives.rows import parse_pair, sample_check


def _cfg(train: Path, block: int = 48, **pref):
    return load_config(
        {
            "model": {"path": "unused"},
            "data": {"train_file": str(train), "block_size": block},
            "train": {"objective": "dpo", "max_steps": 1, "preference": pref},
            "scaling": {"num_workers": 1},
            "run": {"name": "pairs"},
        }
    )


def _tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny["model"]))


def _cache(cfg, tok, tmp: Path) -> PairBlocks:
    opts = data_options(cfg, Settings(block_size=cfg.data.block_size))
    cache = prepare(cfg.data.train_file, tok, cache_root=str(tmp / "cache"), progress=False, **opts)
    return PairBlocks(cache, cfg.data.block_size)


def test_pairs_share_a_prompt_and_train_on_completions(tiny, tmp_path: Path) -> None:
    tok = _tokenizer(tiny)
    cfg = _cfg(write_pairs(tmp_path / "p.jsonl", 6))
    pairs = _cache(cfg, tok, tmp_path)
    assert len(pairs) == 6
    ids, labels, ref = pairs.gather(np.array([4, 1]))
    assert ids.shape == (4, 48) and np.isnan(ref).all()  # chosen 4, chosen 1, rejected 4, 1
    rows = [json.loads(line) for line in Path(cfg.data.train_file).read_text().splitlines()]
    for k, i in enumerate((4, 1)):
        row = rows[i]
        prompt = tok.encode(row["prompt"], add_special_tokens=True)
        for side, r in (("chosen", k), ("rejected", k + 2)):
            completion = [*tok.encode(row[side], add_special_tokens=False), tok.eos_token_id]
            end = len(prompt) + len(completion)
            assert ids[r, : len(prompt)].tolist() == prompt
            assert ids[r, len(prompt) : end].tolist() == completion
            assert labels[r, len(prompt) : end].tolist() == completion  # targets, EOS included
            assert (labels[r, : len(prompt)] == IGNORE).all() and (labels[r, end:] == IGNORE).all()


def test_chat_pairs_render_the_prompt_once(tiny, tmp_path: Path) -> None:
    tok = _tokenizer(tiny)
    tpl = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    cfg = _cfg(write_pairs(tmp_path / "c.jsonl", 4, chat=True))
    opts = data_options(cfg, Settings(block_size=48, chat_template=tpl))
    cache = prepare(
        cfg.data.train_file, tok, cache_root=str(tmp_path / "c"), progress=False, **opts
    )
    ids, labels, _ = PairBlocks(cache, 48).gather(np.array([0]))
    first = [int(np.argmax(row != IGNORE)) for row in labels]
    assert first[0] == first[1] and (ids[0, : first[0]] == ids[1, : first[1]]).all()
    text = tok.decode(ids[0, first[0] :][labels[0, first[0] :] != IGNORE])
    assert "The answer is" in text and "user" not in text


def test_a_long_pair_is_cut_together() -> None:
    prompt, chosen, rejected = list(range(30)), [100] * 12, [200] * 5
    p, c, r, cut = cut_pair(prompt, chosen, rejected, block=24, max_prompt=8)
    assert cut and p == prompt[-12:] and c == chosen and r == rejected  # the prompt gives way
    p, c, r, cut = cut_pair(prompt, [100] * 30, rejected, block=24, max_prompt=8)
    assert p == prompt[-8:] and c == [100] * 16 and r == rejected  # then the completions
    assert cut_pair([1, 2], [3], [4], 24, 8) == ([1, 2], [3], [4], False)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "q", "chosen": " ", "rejected": "b"}, '"chosen" is empty'),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "equals"),
        ({"prompt": "q", "chosen": "a", "rejected": ["b"]}, "must both be strings or both message"),
    ],
)
def test_bad_rows_fail_with_file_and_line(tmp_path: Path, row, problem) -> None:
    assert problem in parse_pair(row)[1]
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{problem}"):
        sample_check(str(path), "data.train_file", "error", 10)


def test_parquet_rows_are_pairs_too(tiny, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(x) for x in write_pairs(tmp_path / "p.jsonl", 4).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    cfg = _cfg(tmp_path / "p.parquet")
    assert len(_cache(cfg, _tokenizer(tiny), tmp_path)) == 4
    rows[2]["rejected"] = rows[2]["chosen"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    with pytest.raises(DataError, match=r"q.parquet:row 3: "):
        _cache(_cfg(tmp_path / "q.parquet"), _tokenizer(tiny), tmp_path)
