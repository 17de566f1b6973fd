"""A mixture-of-experts LoRA export: a tiny Qwen3-MoE whose adapter reaches the fused routed
experts (target_parameters, model.lora.target_modules auto) is merged (merge_on_export)
into a folder that plain transformers loads, and finish_export's check finds its logits
equal to base + adapter within fp32's 1e-5; doubling the experts' delta in the merged
folder fails the check in one line. One process, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 64


def _tokenizer(folder: Path):
    """A word-level tokenizer with exactly the tiny model's 64 ids (no vocabulary growth)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(folder))
    return fast


def _cfg(model_dir: Path):
    from trainer.config import load_config

    return load_config(
        {
            "model": {
                "path": str(model_dir),
                "adapter": "lora",
                "lora": {"r": 4, "alpha": 8, "merge_on_export": True},
            },
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "moe-export"},
        }
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    from tests.unit.model.test_moe_lora import tiny_moe
    from trainer.model import adapters

    root = tmp_path_factory.mktemp("moe")
    model_dir = root / "base"
    tiny_moe("qwen3_moe").save_pretrained(str(model_dir))
    tokenizer = _tokenizer(model_dir)
    cfg = _cfg(model_dir)
    peft = adapters.apply(tiny_moe("qwen3_moe"), cfg, grew_vocab=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for n, p in peft.named_parameters():
            if adapters.is_adapter_weight(n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    out = root / "export"
    adapters.export(peft, out, tokenizer, cfg, model_dir)
    return cfg, model_dir, out, tokenizer


def test_moe_merged_export_loads_plainly_and_matches_base_plus_adapter(exported) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export_check import (
        CHECKS_FILE,
        compare,
        finish_export,
        fixed_batch,
        logits_of,
    )

    cfg, model_dir, out, tokenizer = exported
    assert "experts.gate_up_proj" in (out / "adapter" / "adapter_config.json").read_text()
    finish_export(out, model_dir, cfg, tokenizer)
    (entry,) = json.loads((out / CHECKS_FILE).read_text())["checks"]
    assert entry["export"] == "model_merged" and entry["passed"]
    assert entry["rel_error"] <= entry["tolerance"] == 1e-5
    # Plain transformers, no PEFT: the experts' deltas are in the merged weights.
    merged = AutoModelForCausalLM.from_pretrained(str(out / "model_merged"))
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    moved = (dict(merged.named_parameters())[key] - dict(base.named_parameters())[key]).detach()
    assert float(moved.abs().max()) > 1e-3  # the experts' adapter is merged, not dropped
    ids = fixed_batch(VOCAB)
    assert compare("m", "base", logits_of(merged, ids), logits_of(base, ids), 1e-5).rel_error > 1e-3


def test_a_wrong_experts_merge_fails(exported, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export_check import ExportCheckError, check_merged, require

    cfg, model_dir, out, tokenizer = exported
    bad = tmp_path / "export"
    shutil.copytree(out, bad)
    merged = AutoModelForCausalLM.from_pretrained(str(bad / "model_merged"))
    base = dict(AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters())
    key = "model.layers.1.mlp.experts.down_proj"
    with torch.no_grad():
        p = dict(merged.named_parameters())[key]
        p.copy_(base[key] + 2.0 * (p - base[key]))  # the experts' delta scaled twice
    merged.save_pretrained(str(bad / "model_merged"))
    check = check_merged(bad, model_dir, cfg, len(tokenizer))
    assert not check.passed and check.rel_error > 10 * check.tolerance
    with pytest.raises(ExportCheckError) as err:
        require(check)
    assert "\n" not in str(err.value) and "model_merged" in str(err.value)
