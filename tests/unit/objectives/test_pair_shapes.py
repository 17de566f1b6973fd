"""Preference rows in the shapes users bring, read as TRL 1.16 reads them (TRL is the
oracle): explicit prompt, implicit prompt (HH-RLHF, text and chat) and a string prompt with
conversational answers (UltraFeedback). The same rows through Raylift's pair cache and
through TRL's own preparation (maybe_extract_prompt, then DPOTrainer._prepare_dataset)
give the same prompt, chosen and rejected token ids."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trainer.data.tokenize import IGNORE, Settings, prepare
from trainer.objectives.pairs import PairBlocks, PairSettings, tokenize_pairs
from trainer.objectives.rows import EXPLICIT, IMPLICIT, STRING_PROMPT, parse_pair

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BLOCK = 128


def _msgs(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


Q1, Q2 = "What is 12 plus 30?", "And 7 times 6?"
HH_HEAD = f"\n\nHuman: {Q1}\n\nAssistant: 42.\n\nHuman: {Q2}\n\nAssistant:"
ROWS = {
    EXPLICIT: [
        {"prompt": Q1, "chosen": " The answer is 42.", "rejected": " Maybe 41?"},
        {
            "prompt": _msgs(("user", Q1)),
            "chosen": _msgs(("assistant", "The answer is 42.")),
            "rejected": _msgs(("assistant", "Maybe 41?")),
        },
    ],
    IMPLICIT: [
        {"chosen": HH_HEAD + " It is 42.", "rejected": HH_HEAD + " No idea."},
        {
            "chosen": _msgs(("user", Q1), ("assistant", "42."), ("user", Q2), ("assistant", "42")),
            "rejected": _msgs(("user", Q1), ("assistant", "42."), ("user", Q2), ("assistant", "x")),
        },
    ],
    STRING_PROMPT: [
        {
            "prompt": Q1,
            "chosen": _msgs(("user", Q1), ("assistant", "The answer is 42.")),
            "rejected": _msgs(("user", Q1), ("assistant", "Maybe 41?")),
            "messages": "extra columns are ignored",
        }
    ],
}


def _tokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["model"]))
    tok.chat_template = TEMPLATE
    return tok


def _ours(rows: list[dict], tok, tmp: Path) -> list[tuple[list[int], list[int], list[int]]]:
    """Each pair's (prompt, chosen, rejected) ids as the cache holds them."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = PairSettings(block_size=BLOCK, max_prompt_tokens=BLOCK // 2)
    cache = prepare(
        str(path),
        tok,
        cache_root=str(tmp / "cache"),
        progress=False,
        settings=settings,
        tokenize_shards=tokenize_pairs,
    )
    pairs = PairBlocks(cache, BLOCK)
    out = []
    for i in range(len(pairs)):
        ids, labels, _ = pairs.gather(np.array([i]))
        sides = []
        for row_ids, row_labels in zip(ids, labels, strict=True):
            start = int(np.argmax(row_labels != IGNORE))
            sides.append((row_ids[:start].tolist(), row_ids[row_labels != IGNORE].tolist()))
        assert sides[0][0] == sides[1][0]  # one prompt for both sides
        out.append((sides[0][0], sides[0][1], sides[1][1]))
    return out


def _trl(rows: list[dict], tok) -> list[tuple[list[int], list[int], list[int]]]:
    """TRL's reading: maybe_extract_prompt (what TRL's docs apply to UltraFeedback), then
    DPOTrainer's own dataset preparation (its prompt extraction, EOS, tokenization)."""
    from datasets import Dataset
    from trl import DPOTrainer
    from trl.data_utils import maybe_extract_prompt

    fields = ("prompt", "chosen", "rejected")
    data = Dataset.from_list([{k: r[k] for k in fields if k in r} for r in rows])
    if "prompt" in data.column_names:
        data = data.map(maybe_extract_prompt)
    # what _prepare_dataset reads of DPOConfig (no truncation: the block holds every row)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    stand_in = SimpleNamespace(_tokenizer=tok)
    done = DPOTrainer._prepare_dataset(stand_in, data, tok, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in done]


@pytest.mark.parametrize("shape", list(ROWS))
def test_shapes_read_as_trl_reads_them(shape: str, tiny, tmp_path: Path) -> None:
    tok = _tokenizer(tiny)
    for k, row in enumerate(ROWS[shape]):
        pair, problem = parse_pair(row)
        assert problem is None and pair is not None and pair.shape == shape
        ours = _ours([row], tok, tmp_path / str(k))
        theirs = _trl([row], tok)
        assert ours == theirs
        prompt, chosen, rejected = ours[0]
        assert prompt and chosen and rejected and chosen != rejected


def test_hh_prompt_ends_at_the_assistant_turn() -> None:
    """HH text: the prompt is cut just after the last shared "\\n\\nAssistant:"; when both
    answers begin alike TRL's character prefix takes "Sure, 4" into the prompt."""
    pair, _ = parse_pair({"chosen": HH_HEAD + " Sure, 42.", "rejected": HH_HEAD + " Sure, 41."})
    assert pair is not None and pair.prompt == HH_HEAD
    assert (pair.chosen, pair.rejected) == (" Sure, 42.", " Sure, 41.")
    from trl.data_utils import extract_prompt

    assert (
        extract_prompt({"chosen": HH_HEAD + " Sure, 42.", "rejected": HH_HEAD + " Sure, 41."})[
            "prompt"
        ]
        == HH_HEAD + " Sure, 4"
    )


def test_chat_implicit_prompt_is_the_shared_turns() -> None:
    pair, _ = parse_pair(ROWS[IMPLICIT][1])
    assert pair is not None
    assert pair.prompt == (("user", Q1), ("assistant", "42."), ("user", Q2))
    assert pair.chosen == (("assistant", "42"),) and pair.rejected == (("assistant", "x"),)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        # no shape: no shared turn to take a prompt from
        ({"chosen": "It is 42.", "rejected": "No idea."}, 'share no "Assistant:" turn'),
        (
            {"chosen": _msgs(("user", "a"), ("assistant", "b")), "rejected": _msgs(("user", "c"))},
            "share no first message",
        ),
        # a string prompt the conversations do not repeat
        (
            {
                "prompt": "Something else?",
                "chosen": _msgs(("user", Q1), ("assistant", "42")),
                "rejected": _msgs(("user", Q1), ("assistant", "41")),
            },
            "do not repeat it",
        ),
        # two shapes: explicit prompt, and implicit one repeated in the answers
        (
            {"prompt": HH_HEAD, "chosen": HH_HEAD + " 42", "rejected": HH_HEAD + " 41"},
            f"fits two shapes, {EXPLICIT} and {IMPLICIT}",
        ),
        (
            {
                "prompt": _msgs(("user", Q1)),
                "chosen": _msgs(("user", Q1), ("assistant", "42")),
                "rejected": _msgs(("user", Q1), ("assistant", "41")),
            },
            "fits two shapes",
        ),
        # a KTO row given to a pair objective
        ({"prompt": "q", "completion": "a", "label": True}, "train.objective: kto"),
        ({"chosen": HH_HEAD + " 42", "rejected": HH_HEAD + " 42"}, "equals"),
    ],
)
def test_rows_fitting_no_shape_or_two_are_one_line_errors(row: dict, problem: str) -> None:
    pair, why = parse_pair(row)
    assert pair is None and why is not None and problem in why and "\n" not in why


def test_settings_key_changes_with_unpaired() -> None:
    pairs, kto = PairSettings(block_size=BLOCK), PairSettings(block_size=BLOCK, unpaired=True)
    assert len({pairs.key(), kto.key(), Settings(block_size=BLOCK).key()}) == 3


def test_columns_map_a_files_names(tiny, tmp_path: Path) -> None:
    """data.columns: {prompt: question, chosen: response_j, rejected: response_k} reads a
    StackExchange-style file as the same pairs as the standard names; a mapped column the
    file lacks is a one-line error naming file:line."""
    from trainer.errors import DataError

    tok = _tokenizer(tiny)
    row = ROWS[EXPLICIT][0]
    named = {"question": row["prompt"], "response_j": row["chosen"], "response_k": row["rejected"]}
    columns = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    path = tmp_path / "se.jsonl"
    path.write_text(json.dumps(named) + "\n")
    settings = PairSettings(block_size=BLOCK, max_prompt_tokens=BLOCK // 2)
    opts = dict(settings=settings, tokenize_shards=tokenize_pairs, progress=False)
    cache = prepare(str(path), tok, cache_root=str(tmp_path / "c"), columns=columns, **opts)
    ids, labels, _ = PairBlocks(cache, BLOCK).gather(np.array([0]))
    want = _ours([row], tok, tmp_path / "std")[0]
    start = int(np.argmax(labels[0] != IGNORE))
    assert (ids[0, :start].tolist(), ids[0][labels[0] != IGNORE].tolist()) == want[:2]
    with pytest.raises(DataError, match=r"se.jsonl:1: missing column 'answer_k' \(for rejected\)"):
        prepare(
            str(path),
            tok,
            cache_root=str(tmp_path / "d"),
            columns=dict(columns, rejected="answer_k"),
            **opts,
        )


def test_validation_says_which_shape_a_file_was_read_as(tmp_path: Path) -> None:
    from trainer.preflight import Report, check_data_file

    path = tmp_path / "hh.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[IMPLICIT][0]] * 3))
    report = Report()
    check_data_file(str(path), "data.train_file", True, "error", report, "dpo")
    note = f"data.train_file {path}: read as pairs, {IMPLICIT} (3 of the first rows)"
    assert report.notes == [note]
