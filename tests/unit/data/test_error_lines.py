"""The data errors a user meets first are one line each, with file:line or the field, and
come before launch: `python -m trainer validate` (the laptop's preflight) stops a broken
jsonl line and a data.columns mapping to a column the rows lack, for SFT, preference and
KTO files alike; `python -m trainer run` stops a Hub id that cannot be resolved before
any worker starts (huggingface_hub offline over an empty cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROWS = {
    "sft": [{"text": f"row {i} of the corpus"} for i in range(4)],
    "dpo": [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(4)],
    "kto": [{"prompt": f"q{i}", "completion": f"a{i}", "label": i % 2 == 0} for i in range(4)],
}


def _file(tmp_path: Path, objective: str, broken: bool) -> Path:
    lines = [json.dumps(r) for r in ROWS[objective]]
    if broken:
        lines.insert(1, lines[0][:-3])  # a row cut short: line 2
    path = tmp_path / f"{objective}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto"])
def test_a_broken_line_and_a_missing_column_stop_validation(job, tmp_path, capsys, objective):
    from trainer.__main__ import main

    train = {} if objective == "sft" else {"objective": objective}
    data = {"eval_file": None, "block_size": 32}
    broken = _file(tmp_path, objective, broken=True)
    path = job("broken", data={**data, "train_file": str(broken)}, train=train)
    assert main(["validate", str(path)]) == 2
    err = _error_line(capsys)
    assert err.startswith(f"error: {broken}:2: not valid JSON"), err
    assert err.endswith("fix the row or set data.on_bad_line: skip"), err

    good = _file(tmp_path, objective, broken=False)
    columns = {"prompt": "question"} if objective != "sft" else {"text": "body"}
    path = job("mapped", data={**data, "train_file": str(good), "columns": columns}, train=train)
    assert main(["validate", str(path)]) == 2
    err = _error_line(capsys)
    want = next(iter(columns.items()))
    assert f"{good}:1: missing column '{want[1]}' (for {want[0]})" in err, err
    assert "data.columns maps it: fix the mapping or the row" in err, err


@pytest.mark.parametrize(
    ("section", "spec", "problem"),
    [
        ("model", "tiny-org/no-such-model", "holds no copy of tiny-org/no-such-model@main"),
        ("data", "hf://datasets/tiny-org/no-such-set", "holds no copy of tiny-org/no-such-set"),
    ],
)
def test_an_unresolvable_hub_id_stops_the_run_before_launch(
    job, tmp_path, capsys, monkeypatch, section, spec, problem
):
    import huggingface_hub.constants as constants

    from trainer.__main__ import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shared = str(tmp_path / "shared")
    if section == "model":
        path = job("hub", model={"path": spec}, data={"cache_dir": shared})
    else:
        path = job("hub", data={"train_file": spec, "eval_file": None, "cache_dir": shared})
    assert main(["run", str(path)]) == 2  # from the driver's first step: no worker started
    err = _error_line(capsys)
    assert problem in err and spec in err, err
