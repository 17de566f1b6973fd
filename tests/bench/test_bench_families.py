"""The model-family matrix (issue 50, docs/models.md): every family the trainer is checked
on, as a tiny random model built from its own transformers config with the test
tokenizer and data, trained end to end through the real entry (`python -m trainer run`
under torchrun, gloo, 2 CPU workers) in each cell: DDP, FSDP2, ZeRO-3, LoRA and QLoRA on
DDP and FSDP2, and pp=2 where the family allows it (refused at preflight in one line
where it does not). No family-specific setting in any job: attention and adapter
targets are the family's own.

Each cell passes when the run trains (the loss falls), a run stopped at the middle
checkpoint and resumed ends with the uninterrupted run's losses and gradient norms
(exact resume), and its export loads by the docs' recipe and reproduces the trained
model's logits (QLoRA's adapter is served on the full-precision base, which is not the
4-bit base it trained on: there it must load and compute finite logits). Document
attention is on in every cell but pp=2 (the pipeline refuses it in this build).

    make bench   (or: pytest tests/bench/test_bench_families.py -s -o testpaths=tests/bench)

RAYLIFT_BENCH_FAMILIES and RAYLIFT_BENCH_FAMILY_CELLS (comma-separated) pick a part of
the matrix; a smoke run (make test) only checks that Gemma 2 with pp=2 is refused at
preflight (tests/integration/test_family_runs.py trains through the same entry).
Writes build/bench/families.json (the share of cells that pass) and families_matrix.json
(every cell: what passed, how long it took, a failed run's log tail).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from benchutil import Check, results_dir, run_benchmark, smoke

from tests.support.families import FAMILIES, build_family
from tests.support.jobs import base_job
from tests.support.torchrun import torchrun
from trainer.model import families

STEPS = 4
CELLS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": {"name": "ddp"}},
    "fsdp": {"strategy": {"name": "fsdp"}},
    "zero3": {"strategy": {"name": "deepspeed", "config": "zero3"}},
    "ddp_lora": {"strategy": {"name": "ddp"}, "model": {"adapter": "lora"}},
    "ddp_qlora": {"strategy": {"name": "ddp"}, "model": {"adapter": "qlora"}},
    "fsdp_lora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "lora"}},
    "fsdp_qlora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "qlora"}},
    "pp2": {
        "strategy": {"name": "fsdp", "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
        "train": {"micro_batch_size": 4},
        "data": {"attention": "causal"},
    },
}
SMOKE = {"gemma2": ["pp2"]}


def _picked() -> dict[str, list[str]]:
    if smoke() and not os.environ.get("RAYLIFT_BENCH_FAMILIES"):
        return SMOKE
    fams = [f for f in os.environ.get("RAYLIFT_BENCH_FAMILIES", "").split(",") if f]
    cells = [c for c in os.environ.get("RAYLIFT_BENCH_FAMILY_CELLS", "").split(",") if c]
    return {f: cells or list(CELLS) for f in fams or FAMILIES}


def _job(tiny: dict[str, Path], model: Path, runs: Path, name: str, cell: str) -> Path:
    data = base_job(tiny, runs, name)
    data["model"]["path"] = str(model)
    data["data"]["attention"] = "document"
    data["train"].update({"max_steps": STEPS, "eval_every": 2, "micro_batch_size": 2})
    data["checkpoint"] = {"every_steps": 2, "keep_last": 2}
    for section, values in CELLS[cell].items():
        data.setdefault(section, {}).update(values)
    path = runs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(path: Path, *overrides: str) -> None:
    args = ["-m", "trainer", "run", str(path)]
    for o in overrides:
        args += ["--set", o]
    res = torchrun(args, nproc=2, timeout=900)
    if res.returncode:
        raise AssertionError(res.stderr[-3000:])


def _curve(run: Path) -> list[tuple[int, float, float]]:
    from trainer.observability.metrics import lineage, read_records
    from trainer.storage.location import resolve

    steps, _ = lineage(read_records(resolve(str(run.parent)).join(run.name, "metrics.jsonl")))
    return [(r["step"], r["loss"], r["grad_norm"]) for r in steps]


def _export_reproduces(run: Path, model_dir: Path, qlora: bool) -> bool:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe = json.loads((run / "final_probe.json").read_text())
    x, want = torch.tensor(probe["input_ids"]), torch.tensor(probe["logits"])
    out = run / "export" / f"step_{STEPS:08d}"
    if (out / "adapter").is_dir():  # the docs' recipe: base, grown vocabulary, adapter
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(str(out / "adapter"))))
        model = PeftModel.from_pretrained(base, str(out / "adapter"))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    with torch.no_grad():
        got = model.eval()(input_ids=x).logits
    if qlora:
        return bool(torch.isfinite(got).all())
    return bool(torch.allclose(got, want, atol=1e-4))


def _refused(tiny: dict[str, Path], model: Path, runs: Path, family: str) -> dict[str, Any]:
    """pp=2 for a family the stage builder does not take: one line at preflight."""
    from trainer.config import load_config
    from trainer.errors import UserError
    from trainer.preflight import run_all

    cfg = load_config(_job(tiny, model, runs, f"{family}-pp2", "pp2"), [])
    try:
        run_all(cfg, strict=False)
    except UserError as exc:
        msg = str(exc)
        return {"ok": "\n" not in msg and "strategy.pp" in msg, "refused": msg}
    return {"ok": False, "refused": None}


def _cell(tiny: dict[str, Path], model: Path, runs: Path, family: str, cell: str) -> dict:
    if cell == "pp2" and not families.FAMILIES[family].pipeline:
        return _refused(tiny, model, runs, family)
    name = f"{family}-{cell}"
    t0 = time.perf_counter()
    _train(_job(tiny, model, runs, name, cell))
    ref = _curve(runs / name)
    result: dict[str, Any] = {"trains": ref[-1][1] < ref[0][1], "steps": len(ref)}
    result["export"] = _export_reproduces(runs / name, model, "qlora" in cell)
    if not smoke():
        cut = _job(tiny, model, runs, f"{name}-cut", cell)
        _train(cut, f"train.stop_at_step={STEPS // 2}")
        _train(cut)
        got = _curve(runs / f"{name}-cut")
        result["resume_exact"] = got == ref
        if not result["resume_exact"]:
            result["curves"] = {"ref": ref, "resumed": got}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = all(v for k, v in result.items() if k in ("trains", "export", "resume_exact"))
    return result


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench-families")
    return {f: build_family(root / f, f, tiny["model"]) for f in _picked()}


def test_family_matrix(tiny, models, tmp_path):
    picked = _picked()
    matrix: dict[str, dict[str, Any]] = {}

    def everything(i: int) -> dict[str, float]:
        for family, cells in picked.items():
            for cell in cells:
                runs = tmp_path / f"r{i}"
                runs.mkdir(exist_ok=True)
                try:
                    out = _cell(tiny, models[family], runs, family, cell)
                except AssertionError as exc:
                    out = {"ok": False, "error": str(exc)[-1500:]}
                matrix.setdefault(family, {})[cell] = out
                print(family, cell, json.dumps(out)[:300], flush=True)
        cells = [c for f in matrix.values() for c in f.values()]
        return {"passed": sum(bool(c["ok"]) for c in cells), "cells": len(cells)}

    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        run_benchmark(
            "families",
            title="Model families: cells of the matrix that train, resume exactly and export",
            commands={"matrix": everything},
            checks=[
                Check("share_passed", lambda r: r["matrix"]["passed"] / r["matrix"]["cells"], 1.0)
            ],
            metric="share of cells",
            setup={"families": picked, "steps": STEPS},
            rounds=1,
        )
    finally:
        (out / "families_matrix.json").write_text(json.dumps(matrix, indent=1))
