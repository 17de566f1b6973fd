"""`python -m trainer data` and `raylift data`: the shape, the counts and the first rows of
each source, the trained tokens marked. The counts are checked against the manifests of
the caches the run itself builds (`prepare_inputs`), the marks against the rows' answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.data import write
from tests.unit.data.test_shapes import TEMPLATE
from trainer.config import load_config

QA = [
    {"question": f"What is {i} plus 2?", "answer": f"{i} plus 2 is {i + 2}.", "id": i}
    for i in range(12)
]
ALPACA = [
    {"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i)))}
    for i in range(1, 40)
]


@pytest.fixture
def data_job(job, tmp_path):
    qa = write(tmp_path / "qa.jsonl", QA)
    alpaca = write(tmp_path / "alpaca.jsonl", ALPACA)
    return job(
        "preview",
        data={
            "train_file": [
                {"path": str(qa), "columns": {"prompt": "question", "completion": "answer"}},
                {"path": str(alpaca), "name": "count"},
            ],
            "chat_template": TEMPLATE,
            "block_size": 48,
            "long_rows": "drop",
        },
    )


def counts(text: str, source: str) -> dict[str, int]:
    m = re.search(
        rf"train source {source} .*\n  every row: (\d+) rows, (\d+) tokens, (\d+) trained "
        r"\([\d.]+ %\); (\d+) longer than a block of 48 \(dropped\), (\d+) dropped",
        text,
    )
    assert m, text
    keys = ("documents", "num_tokens", "trained_tokens", "long_rows", "dropped_rows")
    return dict(zip(keys, map(int, m.groups()), strict=True))


def test_counts_match_the_manifest_and_answers_are_marked(data_job, capsys):
    from trainer.__main__ import main
    from trainer.runtime.launch import prepare_inputs

    assert main(["data", str(data_job), "--rows", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "train source qa " in out and "read as prompt/completion" in out
    assert "prompt ← question" in out and "completion ← answer" in out
    assert "extra fields ignored: id" in out
    assert "train source count " in out and "read as alpaca (trained: the output)" in out

    prepared = prepare_inputs(load_config(data_job), progress=False)
    for name, cache in zip(("qa", "count"), prepared.train_caches, strict=True):
        meta = json.loads((Path(cache) / "manifest.json").read_text())
        want = {k: meta[k] for k in counts(out, name)}
        assert counts(out, name) == want
    assert counts(out, "count")["dropped_rows"] > 0  # the long Alpaca rows

    # The first rows: only each answer (and its EOS) is in brackets.
    rows = re.findall(r"  row \d+ \((\d+) tokens, (\d+) trained\):\n    (.*)\n    ids: (.*)", out)
    assert len(rows) == 6  # two of each train source, two of the base job's eval file
    marked = [re.findall(r"\[\[(.*?)\]\]", text) for _, _, text, _ in rows[:4]]
    assert marked[:2] == [["0 plus 2 is 2.</s>"], ["1 plus 2 is 3.</s>"]]
    assert marked[2:] == [["0</s>"], ["0 1</s>"]]
    assert "[[" not in rows[0][2].split("<|assistant|>")[0]
    for _, n_trained, _, ids in rows:
        trained_ids = " ".join(re.findall(r"\[\[(.*?)\]\]", ids)).split()
        assert len(trained_ids) == int(n_trained)


def test_raylift_data_marks_in_colour_on_request(data_job, capsys):
    from tools.cli import main

    assert main(["data", str(data_job), "--rows", "1", "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[32m0 plus 2 is 2.</s>\x1b[0m" in out and "[[" not in out


def test_a_missing_column_is_one_line(data_job, capsys):
    from tools.cli import main

    bad = json.dumps([{"path": str(data_job.parent / "qa.jsonl"), "columns": {"prompt": "q"}}])
    assert main(["data", str(data_job), "--set", f"data.train_file={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.match(r"error: .*qa\.jsonl:1: missing column 'q' \(for prompt\)", err), err


def test_pairs_show_chosen_beside_rejected_and_kto_rows_their_label(job, tmp_path, capsys):
    """Mapped pair columns; each pair's two sides one after the other, the prompt shared
    and unmarked, each completion marked; a KTO row's completion marked with its label."""
    from tests.support.preference import write_pairs
    from trainer.__main__ import main

    pairs = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in write_pairs(pairs, 5).read_text().splitlines()]
    pairs.write_text(
        "".join(
            json.dumps({"q": r["prompt"], "response_j": r["chosen"], "response_k": r["rejected"]})
            + "\n"
            for r in rows
        )
    )
    path = job(
        "pairs",
        model={"special_tokens": None},
        data={
            "train_file": str(pairs),
            "eval_file": None,
            "block_size": 40,
            "columns": {"prompt": "q", "chosen": "response_j", "rejected": "response_k"},
        },
        train={"objective": "dpo"},
    )
    assert main(["data", str(path), "--rows", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "read as preference pairs" in out and "every row: 5 rows" in out
    shown = re.findall(r"  pair (\d) (chosen|rejected) .*\n    (.*)\n", out)
    assert [(n, side) for n, side, _ in shown] == [
        ("1", "chosen"),
        ("1", "rejected"),
        ("2", "chosen"),
        ("2", "rejected"),
    ]
    for (_, _, chosen), (_, _, rejected), row in zip(shown[::2], shown[1::2], rows, strict=False):
        assert chosen.split("[[")[0] == rejected.split("[[")[0] == f"<s>{row['prompt']}"
        assert chosen.split("[[")[1] == f"{row['chosen']}</s>]]"
        assert rejected.split("[[")[1] == f"{row['rejected']}</s>]]"

    kto = write(
        tmp_path / "kto.jsonl",
        [{"prompt": "2 plus 3?", "completion": "5.", "label": True}] * 3
        + [{"prompt": "2 plus 3?", "completion": "6.", "label": False}],
    )
    path = job(
        "kto",
        model={"special_tokens": None},
        data={"train_file": str(kto), "eval_file": None, "block_size": 40},
        train={"objective": "kto"},
    )
    assert main(["data", str(path), "--rows", "4", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "read as unpaired feedback (KTO)" in out and "every row: 4 rows" in out
    assert re.findall(r"  row \d (\w+) .*\n    <s>2 plus 3\?\[\[(.*)\]\]", out) == [
        ("desirable", "5.</s>"),
        ("desirable", "5.</s>"),
        ("desirable", "5.</s>"),
        ("undesirable", "6.</s>"),
    ]


def pair_counts(text: str) -> dict[str, int]:
    m = re.search(
        r"  every row: (\d+) rows, (\d+) tokens in \d+ padded blocks, (\d+) trained "
        r"\([\d.]+ %\); (\d+) cut to fit a block",
        text,
    )
    assert m, text
    keys = ("documents", "num_tokens", "trained_tokens", "long_rows")
    return dict(zip(keys, map(int, m.groups()), strict=True))


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_pair_counts_match_the_pair_cache_manifest(job, tmp_path, capsys, objective):
    """The preview counts pairs (KTO rows) as the cache the run builds holds them: rows,
    padded blocks, trained completion tokens, and the rows cut to fit a block (the last
    row is longer than one)."""
    from tests.support.preference import write_pairs
    from trainer.__main__ import main
    from trainer.runtime.launch import prepare_inputs

    write_pairs(tmp_path / "p.jsonl", 5)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    long = "Tell me about " + "very " * 30 + "long prompts."
    rows.append({"prompt": long, "chosen": "No.", "rejected": "Yes. " * 20})
    if objective == "kto":
        rows = [
            {"prompt": r["prompt"], "completion": r["rejected"], "label": i % 3 == 0}
            for i, r in enumerate(rows)
        ]
    data = write(tmp_path / f"{objective}.jsonl", rows)
    path = job(
        objective,
        model={"special_tokens": None},
        data={"train_file": str(data), "eval_file": None, "block_size": 40},
        train={"objective": objective, "micro_batch_size": 1, "global_batch_size": 2},
    )
    assert main(["data", str(path), "--color", "never"]) == 0
    got = pair_counts(capsys.readouterr().out)
    (cache,) = prepare_inputs(load_config(path), progress=False).train_caches
    meta = json.loads((Path(cache) / "manifest.json").read_text())
    assert got == {k: meta[k] for k in got}
    assert got["documents"] == 6 and got["long_rows"] == 1
    assert 0 < got["trained_tokens"] < got["num_tokens"] == 6 * 2 * 40
