"""The merged export (model.lora.merge_on_export) is loaded back and checked against base +
adapter before it leaves the worker: a right merge passes within fp32's 1e-5, a wrong
one (a scaled or transposed delta) fails in one line. The DDP strategy writes the export
as in a run, on the tiny Llama and its trained tokenizer; no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.checkpoint.export_check import (
    CHECKS_FILE,
    TOLERANCE,
    ExportCheckError,
    check_merged,
    compare,
    finish_export,
    fixed_batch,
    logits_of,
    require,
)
from trainer.config import load_config
from trainer.model.loading import load_tokenizer
from trainer.strategies.base import ModelSource, build_strategy


def _cfg(model_dir: Path):
    return load_config(
        {
            "model": {"path": str(model_dir), "adapter": "lora", "lora": {"merge_on_export": True}},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "export-check"},
        }
    )


@pytest.fixture(scope="module")
def exported(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A LoRA export whose adapter is far from zero (lora_B starts at zero, which would make
    any merge, right or wrong, equal the base)."""
    model_dir = tiny["model"]
    cfg = _cfg(model_dir)
    tokenizer = load_tokenizer(model_dir, None)
    strategy = build_strategy(cfg, torch.device("cpu"), 0, 1)
    strategy.setup(ModelSource(model_dir, len(tokenizer)))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in strategy.hf.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    out = tmp_path_factory.mktemp("export")
    assert strategy.export(out, 0, tokenizer)
    return cfg, model_dir, out, len(tokenizer)


def test_lora_merged_export_matches_base_plus_adapter(exported) -> None:
    cfg, model_dir, out, vocab = exported
    check = require(check_merged(out, model_dir, cfg, vocab))
    assert check.passed and check.tolerance == TOLERANCE["float32"] == 1e-5
    # The adapter moved the logits far beyond the tolerance, so the check can tell.
    from transformers import AutoModelForCausalLM

    ids = fixed_batch(vocab)
    base = logits_of(AutoModelForCausalLM.from_pretrained(str(model_dir)), ids)
    merged = logits_of(AutoModelForCausalLM.from_pretrained(str(out / "model_merged")), ids)
    assert compare("m", "base", merged, base, 1e-5).rel_error > 1e-2


def _tamper(out: Path, model_dir: Path, how: str) -> None:
    """Rewrite one merged projection as base + a wrong delta."""
    merged = out / "model_merged" / "model.safetensors"
    base = load_file(str(model_dir / "model.safetensors"))
    tensors = load_file(str(merged))
    key = "model.layers.0.self_attn.q_proj.weight"
    delta = tensors[key] - base[key]
    assert float(delta.abs().max()) > 1e-3, "the adapter must move this weight"
    tensors[key] = base[key] + (2.0 * delta if how == "scaled" else delta.T.contiguous())
    save_file(tensors, str(merged), metadata={"format": "pt"})


@pytest.mark.parametrize("how", ["scaled", "transposed"])
def test_wrong_merge_fails_in_one_line(exported, tmp_path: Path, how: str) -> None:
    import shutil

    cfg, model_dir, out, vocab = exported
    bad = tmp_path / "export"
    shutil.copytree(out, bad)
    _tamper(bad, model_dir, how)
    check = check_merged(bad, model_dir, cfg, vocab)
    assert not check.passed and check.rel_error > 100 * check.tolerance
    with pytest.raises(ExportCheckError) as err:
        require(check)
    line = str(err.value)
    assert "\n" not in line and "model_merged" in line and "DO NOT match" in line
    # What the run calls before uploading: it stops there, and writes no proof file.
    with pytest.raises(ExportCheckError):
        finish_export(bad, model_dir, cfg, load_tokenizer(model_dir, None))
    assert not (bad / CHECKS_FILE).exists()


def test_finish_export_records_the_check(exported, tmp_path: Path) -> None:
    import json
    import shutil

    cfg, model_dir, out, _ = exported
    folder = tmp_path / "export"
    shutil.copytree(out, folder)
    finish_export(folder, model_dir, cfg, load_tokenizer(model_dir, None))
    (entry,) = json.loads((folder / CHECKS_FILE).read_text())["checks"]
    assert entry["export"] == "model_merged" and entry["passed"] is True
    assert entry["rel_error"] <= entry["tolerance"] == 1e-5
