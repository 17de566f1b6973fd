"""Prompt rows: text or chat prompts, other columns kept for the rewards, data.columns'
renames, and a bad row refused naming file:line (on the laptop too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.errors import DataError
from trainer.rollouts.rows import parse_prompt_row, sample_check


def test_text_and_chat_prompts_keep_their_columns() -> None:
    row, problem = parse_prompt_row({"prompt": "2+2?", "answer": "4", "id": 7}, {})
    assert problem is None and row.prompt == "2+2?" and row.columns == {"answer": "4", "id": 7}
    chat = [{"role": "user", "content": "hi"}]
    row, _ = parse_prompt_row({"q": chat, "answer": "x"}, {"prompt": "q"})
    assert row.prompt == chat and row.columns == {"answer": "x"}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"question": "x"},
            "no 'prompt' field (the row has ['question']); map it with data.columns",
        ),
        ({"prompt": ""}, "'prompt' is neither text nor a list of {role, content} messages"),
        ({"prompt": [{"role": "user"}]}, "neither text nor a list"),
        ([1, 2], "a row is a JSON object with a 'prompt', got list"),
    ],
)
def test_bad_rows(obj, message: str) -> None:
    row, problem = parse_prompt_row(obj, {})
    assert row is None and message in problem


def test_the_laptop_check_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: no 'prompt' field"):
        sample_check(str(path), "data.train_file", "error", 20)
    assert sample_check(str(path), "data.train_file", "skip", 20) is None
