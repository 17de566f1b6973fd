"""Every SFT shape through the token cache, checked token by token against transformers.

The oracle is `apply_chat_template(..., return_assistant_tokens_mask=True)`: the template
below marks each assistant turn (its text, tool calls and EOS) as a `{% generation %}`
block, so transformers itself says which tokens the loss must see. Each test writes rows
in one shape, tokenizes them with `prepare` and compares the cache's ids and mask to the
conversation the shape means, rendered by transformers. Alpaca rows under a tokenizer
without a chat template are checked against the Alpaca project's prompt, tokenized apart.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.data import write
from trainer.data.tokenize import Settings, prepare
from trainer.errors import DataError
from trainer.model.loading import load_tokenizer

# Each turn is <|role|>content; an assistant turn's content, tool calls and EOS are the
# generation block (what is trained); tools are listed first, as JSON.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m['content'] is defined and m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>"
    "{% endfor %}{% endif %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 plus 3 is 5."},
    {"instruction": "Name a fruit.", "input": "", "output": "An apple."},
    {"instruction": "Count the pens.", "output": "Ana has 4 pens.", "system": "Be brief."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    tok = load_tokenizer(tiny["model"], str(tiny["tokens"]))
    assert not getattr(tok, "chat_template", None)  # the no-template tests rely on it
    return tok


def cached(tmp_path, tokenizer, rows, name="d.jsonl", template=TEMPLATE, bad="error", **kw):
    """(ids, mask) of the whole token stream of `rows`, and the cache's manifest."""
    cache = prepare(
        write(tmp_path / name, rows),
        tokenizer,
        progress=False,
        cache_root=str(tmp_path / "cache"),
        settings=Settings(chat_template=template, on_bad_line=bad),
        **kw,
    )
    ids, mask = [], []
    for shard_ids, shard_mask in cache.shards():
        ids.append(np.asarray(shard_ids, np.int64))
        mask.append(np.ones(len(shard_ids), np.uint8) if shard_mask is None else shard_mask)
    return np.concatenate(ids), np.concatenate(mask), cache.meta


def rendered(tokenizer, conversations, tools=None):
    """transformers' token ids and assistant mask of each conversation, concatenated."""
    ids, mask = [], []
    for msgs in conversations:
        out = tokenizer.apply_chat_template(
            msgs,
            tools=tools,
            chat_template=TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids += list(out["input_ids"])
        mask += list(out["assistant_masks"])
    return np.asarray(ids), np.asarray(mask, np.uint8)


def assert_same(got, want):
    ids, mask = got[0], got[1]
    assert ids.tolist() == want[0].tolist()
    assert mask.tolist() == want[1].tolist()


def alpaca_chat(row):
    user = f"{row['instruction']}\n\n{row['input']}" if row.get("input") else row["instruction"]
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [
        *system,
        {"role": "user", "content": user},
        {"role": "assistant", "content": row["output"]},
    ]


def test_alpaca_is_a_user_turn_and_its_output_under_the_chat_template(tmp_path, tokenizer):
    """The instruction and input are the prompt; only the output (and EOS) is trained.
    The old reader took these rows by their "input" and trained on it alone."""
    got = cached(tmp_path, tokenizer, ALPACA)
    assert_same(got, rendered(tokenizer, [alpaca_chat(r) for r in ALPACA]))
    assert got[2]["shards"][0]["shape"] == "alpaca"
    assert got[2]["trained_tokens"] == int(got[1].sum()) < len(got[0]) // 2


def test_alpaca_without_a_template_is_the_alpaca_prompt(tmp_path, tokenizer):
    """No chat template anywhere: the Alpaca project's prompt, then the output."""
    ids, mask, _ = cached(tmp_path, tokenizer, ALPACA, template=None)
    want_ids, want_mask = [], []
    for row in ALPACA:
        head = row.get("system") or (
            "Below is an instruction that describes a task, paired with an input that provides "
            "further context. Write a response that appropriately completes the request."
            if row.get("input")
            else "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request."
        )
        prompt = f"{head}\n\n### Instruction:\n{row['instruction']}\n\n"
        if row.get("input"):
            prompt += f"### Input:\n{row['input']}\n\n"
        prompt += "### Response:\n"
        p = tokenizer(prompt)["input_ids"]  # with BOS
        c = tokenizer(row["output"], add_special_tokens=False)["input_ids"]
        want_ids += [*p, *c, tokenizer.eos_token_id]
        want_mask += [0] * len(p) + [1] * (len(c) + 1)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask


def test_sharegpt_turns_map_to_chat_roles(tmp_path, tokenizer):
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "What is 2 plus 3?"},
                {"from": "gpt", "value": "5."},
                {"from": "user", "value": "And 4 times 2?"},
                {"from": "assistant", "value": "8."},
            ],
            "id": "row-1",
        },
        {
            "messages": [
                {"from": "human", "value": "Add 2 and 3."},
                {"from": "function_call", "value": '{"name": "add"}'},
                {"from": "observation", "value": "5"},
                {"from": "gpt", "value": "It is 5."},
            ],
        },
    ]
    got = cached(tmp_path, tokenizer, rows)
    want = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "5."},
            {"role": "user", "content": "And 4 times 2?"},
            {"role": "assistant", "content": "8."},
        ],
        [
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": '{"name": "add"}'},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
        ],
    ]
    assert_same(got, rendered(tokenizer, want))
    shard = got[2]["shards"][0]
    assert (shard["shape"], shard["extra"]) == ("sharegpt", ["id"])


def test_tool_calls_are_trained_and_tool_results_are_not(tmp_path, tokenizer):
    """The tools column goes to the template; calls are assistant turns, results are not."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    msgs = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 5."},
    ]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    got = cached(tmp_path, tokenizer, [{"messages": msgs, "tools": TOOLS}, {"messages": plain}])
    want_tools = rendered(tokenizer, [msgs], tools=TOOLS)
    want_plain = rendered(tokenizer, [plain])
    want = tuple(np.concatenate([a, b]) for a, b in zip(want_tools, want_plain, strict=True))
    assert_same(got, want)
    text = tokenizer.decode(got[0][got[1] == 1].tolist())
    assert "<call>add" in text and "It is 5." in text and "5</s>" not in text.split("</call>")[0]
    assert got[2]["shards"][0]["shape"] == "tool use + chat"


def test_input_alone_and_text_train_every_token(tmp_path, tokenizer):
    for field in ("input", "text"):
        rows = [{field: "Ana has 4 pens."}, {field: "Ben has 7 books."}]
        ids, mask, meta = cached(tmp_path / field, tokenizer, rows)
        want = [
            t for r in rows for t in tokenizer(r[field])["input_ids"] + [tokenizer.eos_token_id]
        ]
        assert ids.tolist() == want and mask.all()
        assert meta["shards"][0]["shape"] == field


def test_prompt_completion_and_mapped_columns(tmp_path, tokenizer):
    """{question, answer} mapped by data.columns reads as prompt/completion does."""
    rows = [{"prompt": "What is 2 plus 3?", "completion": "5."}]
    got = cached(tmp_path, tokenizer, rows)
    msgs = [{"role": "user", "content": rows[0]["prompt"]}, {"role": "assistant", "content": "5."}]
    assert_same(got, rendered(tokenizer, [msgs]))
    mapped = [{"question": "What is 2 plus 3?", "answer": "5.", "prompt": "ignored"}]
    cols = {"prompt": "question", "completion": "answer"}
    again = cached(tmp_path, tokenizer, mapped, name="m.jsonl", columns=cols)
    assert_same(again, got[:2])
    with pytest.raises(DataError, match=r"m2\.jsonl:1: missing column 'answer' \(for completion\)"):
        cached(
            tmp_path, tokenizer, [{"question": "q", "reply": "a"}], name="m2.jsonl", columns=cols
        )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"text": "a", "prompt": "b", "completion": "c"},
            "fits two shapes, text .* prompt/completion",
        ),
        ({"text": "a", "input": "b"}, "fits two shapes, text \\(text\\) and input \\(input\\)"),
        ({"instruction": "a", "input": "b", "prompt": "p", "completion": "c"}, "fits two shapes"),
        ({"question": "a", "answer": "b"}, "fits no shape"),
        (
            {"messages": [{"role": "user", "content": "a"}], "prompt": "b", "completion": "c"},
            "fits two shapes, prompt/completion \\(prompt, completion\\) and chat \\(messages\\)",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "system": "b"}, "fits no shape"),
        (
            {"instruction": "a", "input": "b"},
            "fits no shape \\(its shape fields: instruction, input\\)",
        ),
        ({"messages": [{"who": "me"}]}, '"messages" must be a non-empty list'),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown speaker 'alien'"),
    ],
)
def test_rows_that_fit_two_shapes_or_none_are_errors(tmp_path, tokenizer, row, message):
    with pytest.raises(DataError, match=r"d\.jsonl:1: .*" + message):
        cached(tmp_path, tokenizer, [row])


def test_a_source_keeps_its_first_rows_shape(tmp_path, tokenizer):
    rows = [ALPACA[0], {"text": "plain"}]
    with pytest.raises(
        DataError, match=r"d\.jsonl:2: the row is text, but this source's rows are alpaca"
    ):
        cached(tmp_path, tokenizer, rows)
    # skipped rows are counted and named, never read as another shape
    *_, meta = cached(tmp_path, tokenizer, rows, name="s.jsonl", bad="skip")
    assert (meta["documents"], meta["skipped_lines"]) == (1, 1)


def test_validation_names_the_shape_and_checks_columns(tmp_path, job):
    from trainer.config import load_config
    from trainer.errors import UserError
    from trainer.preflight import run_all

    data = write(tmp_path / "qa.jsonl", [{"q": "2 plus 3?", "a": "5.", "id": 1}] * 3)
    alpaca = write(tmp_path / "alpaca.jsonl", ALPACA)
    path = job(
        data={
            "train_file": [
                {"path": str(data), "columns": {"prompt": "q", "completion": "a"}},
                str(alpaca),
            ],
            "chat_template": TEMPLATE,
        }
    )
    notes = run_all(load_config(path), strict=True).notes
    assert any(
        "(qa)" in n and "read as prompt/completion" in n and "extra fields ignored: id" in n
        for n in notes
    ), notes
    assert any("(alpaca)" in n and "read as alpaca (trained: the output)" in n for n in notes), (
        notes
    )
    with pytest.raises(UserError, match="missing column 'answer'"):
        run_all(
            load_config(
                path,
                [
                    "data.train_file="
                    + json.dumps(
                        [{"path": str(data), "columns": {"prompt": "q", "completion": "answer"}}]
                    )
                ],
            )
        )
    with pytest.raises(UserError, match="unknown target field 'answer'"):
        load_config(path, ['data.columns={"answer": "a"}'])


def test_the_plan_names_each_sources_shape(tmp_path, job):
    from trainer.config import load_config
    from trainer.planner.plan import plan_job

    alpaca = write(tmp_path / "alpaca.jsonl", ALPACA)
    path = job(data={"train_file": [str(alpaca), str(tmp_path / "elsewhere.jsonl")]})
    notes = plan_job(load_config(path), "g5.xlarge").notes
    assert any(
        n.startswith("data.train_file (alpaca)") and "read as alpaca (trained: the output)" in n
        for n in notes
    ), notes
    # a source not on this machine is a note, not a failed plan
    assert any("elsewhere.jsonl: data not found" in n for n in notes), notes
