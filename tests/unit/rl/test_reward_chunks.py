"""Reward tasks' pieces without Ray (train.rl.reward_workers): how a batch is cut into
chunks, that the chunks' values join back in the completions' order, and what a task's
calls report: one outcome per call, stopping at the first bad one with the same words
the in-process runner uses."""

from __future__ import annotations

import pytest

from trainer.config.rl import RewardSpec
from trainer.rewards.checks import batch_error, row_error
from trainer.rewards.chunks import Batch, batch_calls, row_calls, rows_of, run_calls, split

BATCH = Batch.of(
    [f"p{i}" for i in range(5)],
    [f"c{i}" for i in range(5)],
    {"answer": [f"a{i}" for i in range(5)]},
    [[i] * (i + 1) for i in range(5)],
)


def _index(prompts, completions, completion_ids, answer, **kw):
    return [
        float(c[1:]) + 0.5 * len(ids) for c, ids in zip(completions, completion_ids, strict=True)
    ]


def _raises_on_c3(prompts, completions, **kw):
    return [1 / (0 if c == "c3" else 1) for c in completions]


def _wrong_count(prompts, completions, **kw):
    return [1.0] * (len(completions) + 1)


def _bool(prompts, completions, **kw):
    return [True for _ in completions]


@pytest.mark.parametrize(
    ("count", "workers", "sizes"),
    [(5, 2, [3, 2]), (8, 4, [2, 2, 2, 2]), (2, 4, [1, 1]), (7, 1, [7]), (0, 3, [])],
)
def test_split_is_contiguous_even_and_never_empty(count, workers, sizes) -> None:
    parts = split(count, workers)
    assert [len(p) for p in parts] == sizes
    assert [i for p in parts for i in p] == list(range(count))


def test_split_refuses_no_workers() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        split(3, 0)


def test_chunks_join_back_in_the_completions_order() -> None:
    whole = rows_of([v for _, v in run_calls([_index], BATCH, [(0, None)])])
    joined = []
    for rows in split(len(BATCH), 2):
        outcomes = list(run_calls([_index, _index], BATCH.take(rows), batch_calls(2)))
        assert [k for k, _ in outcomes] == ["ok", "ok"]
        joined += rows_of([v for _, v in outcomes])
    assert [r[0] for r in joined] == [r[0] for r in whole] == [0.5, 2.0, 3.5, 5.0, 6.5]
    assert BATCH.take([3]).columns == {"answer": ["a3"]}


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (_raises_on_c3, "raised ZeroDivisionError: division by zero"),
        (_wrong_count, "returned 6 values for 5 completions"),
        (_bool, "returned True (not a finite number)"),
    ],
)
def test_a_task_stops_at_its_first_bad_call(fn, what) -> None:
    out = list(run_calls([_index, fn, _index], BATCH, batch_calls(3)))
    assert out[0][0] == "ok" and out[1:] == [("fault", what)]


def test_the_row_search_names_the_first_row_that_fails() -> None:
    out = list(run_calls([_raises_on_c3], BATCH, row_calls(0, len(BATCH))))
    assert [k for k, _ in out] == ["ok", "ok", "ok", "fault"]  # rows 0-2 pass, row 3 fails
    calls = row_calls(0, len(BATCH))
    assert calls[len(out) - 1] == (0, 3)


def test_messages_are_one_line_naming_the_reward_and_the_row() -> None:
    spec = RewardSpec(function="r.py:check")
    e = row_error(1, spec, "raised KeyError: 'x'", "What is 2 plus 2?\n", "x" * 200)
    assert str(e).startswith(
        "train.rl.rewards[1] (r.py:check) raised KeyError: 'x' on prompt 'What is 2 plus 2?\\n'"
    )
    assert "\n" not in str(e) and "xxx..." in str(e)
    b = batch_error(0, spec, "ran past train.rl.reward_timeout_s = 2 s", 4)
    assert "on a batch of 4 completions (each row alone passes)" in str(b)


def test_gsm8k_shaped_demo_rows_read_as_gsm8k(tmp_path) -> None:
    """tools.demo.gsm8k's rows: `#### N` ends the answer, math_answer scores the SFT
    text's own continuation 1.0 and a wrong sum 0.0."""
    import json

    from tools.demo import gsm8k
    from trainer.rewards.builtin import math_answer

    files = gsm8k.write(tmp_path, 20, largest=9, seed=3)
    rows = [json.loads(x) for x in files["prompts"].read_text().splitlines()]
    texts = [json.loads(x)["text"] for x in files["sft"].read_text().splitlines()]
    assert len(rows) == len(texts) == 20
    a, b = (
        int(w) for w in rows[0]["question"].removeprefix("What is ").rstrip("?").split(" plus ")
    )
    assert rows[0]["answer"].endswith(f"\n#### {a + b}") and 1 <= a <= 9 and 1 <= b <= 9
    questions = [r["question"] for r in rows]
    right = [gsm8k.sft_text(r).removeprefix(r["question"]) for r in rows]
    wrong = [f" {a} plus {b} is {a + b + 1}.\n#### {a + b + 1}"] * 20
    answers = [r["answer"] for r in rows]
    assert math_answer(questions, right, answer=answers) == [1.0] * 20
    assert math_answer(questions[:1], wrong[:1], answer=answers[:1]) == [0.0]
    assert all(t.startswith("What is ") and "\n#### " in t for t in texts)
