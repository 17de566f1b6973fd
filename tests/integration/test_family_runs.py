"""Families other than Llama through the real entry (`python -m trainer run` under
torchrun, gloo, 2 CPU workers; the Ray path runs the same loop), each job with no
family-specific setting: Gemma 2 on FSDP2 with document attention picks its attention
by itself and exports a folder that loads; Phi-3 with LoRA picks its own targets on
DDP. The per-family unit checks are tests/unit/model/test_families.py; the wide matrix
(every strategy and adapter, pp=2, exact resume) is tests/bench/test_bench_families.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.families import build_family
from tests.support.jobs import base_job
from tests.support.torchrun import torchrun
from trainer.observability.metrics import lineage, read_records
from trainer.storage.location import resolve

STEPS = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-runs")


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    return {f: build_family(root / f, f, tiny["model"]) for f in ("gemma2", "phi3")}


def _job(tiny, model_dir: Path, runs: Path, name: str, **sections: dict[str, Any]) -> Path:
    data = base_job(tiny, runs, name)
    data["model"]["path"] = str(model_dir)
    data["train"].update({"max_steps": STEPS, "eval_every": 3, "micro_batch_size": 2})
    data["checkpoint"] = {"every_steps": 3, "keep_last": 2}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = runs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(path: Path, *overrides: str) -> str:
    args = ["-m", "trainer", "run", str(path)]
    for o in overrides:
        args += ["--set", o]
    res = torchrun(args, nproc=2, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stderr


def _steps(runs: Path, name: str) -> list[dict[str, Any]]:
    steps, wasted = lineage(read_records(resolve(str(runs)).join(name, "metrics.jsonl")))
    assert wasted == 0
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def _probe(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
    probe = json.loads((run / "final_probe.json").read_text())
    return torch.tensor(probe["input_ids"]), torch.tensor(probe["logits"])


def _export(run: Path) -> Path:
    return run / "export" / f"step_{STEPS:08d}"


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_gemma2_needs_no_attention_setting_on_fsdp2_with_document_attention(tiny, folders, runs):
    from transformers import AutoModelForCausalLM

    job = {"strategy": {"name": "fsdp"}, "data": {"attention": "document"}}
    log = _train(_job(tiny, folders["gemma2"], runs, "gemma2", **job))
    assert "document attention (eager)" in log  # the run's first line says what auto chose
    steps = _steps(runs, "gemma2")
    assert steps[-1]["loss"] < steps[0]["loss"]
    x, want = _probe(runs / "gemma2")
    model = AutoModelForCausalLM.from_pretrained(str(_export(runs / "gemma2") / "model"))
    assert model.config._attn_implementation == "eager"  # what transformers picks for it
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits, want, atol=1e-5)


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_phi3_lora_needs_no_targets_on_ddp(tiny, folders, runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _train(_job(tiny, folders["phi3"], runs, "phi3-lora", model={"adapter": "lora"}))
    steps = _steps(runs, "phi3-lora")
    assert steps[-1]["loss"] < steps[0]["loss"]
    adapter = _export(runs / "phi3-lora") / "adapter"
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    # The docs' recipe: the base, grown to the tokenizer's special tokens, then the adapter.
    base = AutoModelForCausalLM.from_pretrained(str(folders["phi3"]))
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(str(adapter))))
    served = PeftModel.from_pretrained(base, str(adapter)).eval()
    x, want = _probe(runs / "phi3-lora")
    with torch.no_grad():
        assert torch.allclose(served(input_ids=x).logits, want, atol=1e-5)
