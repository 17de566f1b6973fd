"""GGUF written with llama.cpp's `gguf` package and read back by transformers: on the tiny
Llama (and its byte-level BPE tokenizer), f16's logits match the HF folder's within 1e-2
of the largest logit and q8_0's within 5e-2, the tokenizer encodes alike, and a writer
that leaves HF's rotary layout in Q/K fails the check. No Ray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.checkpoint import gguf_export
from trainer.checkpoint.export_check import (
    CHECKS_FILE,
    ExportCheckError,
    check_gguf,
    finish_export,
    require,
)
from trainer.checkpoint.gguf_export import GGUF_DIR, GgufError, write_gguf
from trainer.config import ConfigError, load_config
from trainer.model.loading import load_tokenizer


def _cfg(model_dir: Path, **export: object):
    return load_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "tiny"},
            "export": export,
        }
    )


@pytest.fixture(scope="module")
def export_dir(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export as a full fine-tune writes it (export/step_<N>/model/), both GGUF types
    added and checked by what the run calls before uploading."""
    out = tmp_path_factory.mktemp("export")
    shutil.copytree(tiny["model"], out / "model")
    cfg = _cfg(tiny["model"], formats=["hf", "gguf"], gguf_types=["f16", "q8_0"])
    finish_export(out, tiny["model"], cfg, load_tokenizer(tiny["model"], None))
    return out


def test_f16_and_q8_0_round_trip_within_their_tolerances(export_dir: Path) -> None:
    checks = {c["export"]: c for c in json.loads((export_dir / CHECKS_FILE).read_text())["checks"]}
    f16, q8 = checks["gguf/tiny-f16.gguf"], checks["gguf/tiny-q8_0.gguf"]
    assert f16["passed"] and f16["tolerance"] == 1e-2 and f16["rel_error"] <= 1e-2
    assert q8["passed"] and q8["tolerance"] == 5e-2 and q8["rel_error"] <= 5e-2
    # q8_0 is the coarser of the two, and the smaller file.
    assert q8["rel_error"] > f16["rel_error"]
    files = export_dir / GGUF_DIR
    assert (files / "tiny-q8_0.gguf").stat().st_size < (files / "tiny-f16.gguf").stat().st_size


def test_the_tokenizer_reads_back_the_same(export_dir: Path, tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(str(export_dir / GGUF_DIR), gguf_file="tiny-f16.gguf")
    hf = AutoTokenizer.from_pretrained(str(tiny["model"]))
    text = "Q: what is 12 plus 7? A: 19, so 12 + 7 = 19."
    assert back(text).input_ids == hf(text).input_ids
    assert back.decode(hf(text).input_ids, skip_special_tokens=True) == text


def test_a_writer_that_keeps_hf_rotary_layout_fails(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_export, "_rotary_interleave", lambda w, heads: w)
    path = write_gguf(tiny["model"], tmp_path, "f32")
    check = check_gguf(path, tiny["model"], "f32")
    assert not check.passed and check.rel_error > 1e-3
    with pytest.raises(ExportCheckError) as err:
        require(check)
    line = str(err.value)
    assert "\n" not in line and "DO NOT match" in line and "gguf/model-f32.gguf" in line


def test_gguf_refuses_what_it_cannot_write(tiny: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny["model"], folder)
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "model_type": "gpt2"}))
    with pytest.raises(GgufError, match=r"model_type llama.*'gpt2': drop gguf"):
        write_gguf(folder, tmp_path / "out", "f16")
    with pytest.raises(ConfigError, match="list hf"):
        _cfg(tiny["model"], formats=["gguf"])
    with pytest.raises(ConfigError, match="merge_on_export: true"):
        load_config(
            {
                "model": {"path": str(tiny["model"]), "adapter": "lora"},
                "data": {"train_file": "unused.jsonl", "block_size": 16},
                "train": {"micro_batch_size": 2, "max_steps": 2},
                "scaling": {"num_workers": 1},
                "run": {"name": "tiny"},
                "export": {"formats": ["hf", "gguf"]},
            }
        )


def test_report_and_status_name_the_export_and_its_checks(export_dir: Path, tmp_path: Path):
    from tools.report.run import summary_lines
    from trainer.checkpoint.export_check import export_lines
    from trainer.storage.location import resolve

    run = tmp_path / "run"
    shutil.copytree(export_dir, run / "export" / "step_00000002")
    lines = export_lines(resolve(str(run)))
    head, f16, q8 = lines
    assert head.startswith(f"export: {run}/export/step_00000002 (")
    assert "gguf/tiny-f16.gguf" in head and "gguf/tiny-q8_0.gguf" in head and "model" in head
    assert f16.startswith("checked: gguf/tiny-f16.gguf: logits match model/")
    assert q8.startswith("checked: gguf/tiny-q8_0.gguf: logits match") and "5e-02" in q8
    steps = [{"step": 2, "loss": 1.0, "tokens_per_s": 10.0}]
    report = {"steps": steps, "evals": [], "restarts": 0, "wasted_steps": 0, "exports": lines}
    assert summary_lines(report)[-3:] == lines
    from tools.jobcli import runs
    from tools.jobcli.verbs import submission_export_lines

    meta = {"raylift_storage": str(tmp_path), runs.RUN_KEY: "run"}
    assert submission_export_lines(meta) == lines  # what `raylift status` prints, by label
    # A run whose export predates checks.json says so rather than passing it off as checked.
    (run / "export" / "step_00000002" / CHECKS_FILE).unlink()
    assert "written unchecked" in export_lines(resolve(str(run)))[0]
