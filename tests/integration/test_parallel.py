"""(dp, pp, tp) layouts under torchrun (gloo, CPU, a 4-layer tiny Llama with GQA): each
layout's loss curve equals DDP's on the same data and global batch, a checkpoint written
under one layout (and world size) resumes under another, and the export of a pipelined
run (one safetensors shard per stage) loads in plain transformers and reproduces the
trained model's logits; MFU counts the whole model and eval reads the same blocks under
every layout and world size.

Six torchrun jobs in all (one DDP reference, DDP on one worker, tp=2, pp=2 interleaved,
dp=2×tp=2 stopped at step 4 and resumed as dp=2×pp=2), no Ray: the Ray path is the same
loop and strategy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.jobs import base_job
from tests.support.torchrun import torchrun
from trainer.observability.metrics import lineage, read_records
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow

STEPS = 8
LOSS_TOL = 1e-5
"""Per-step loss difference allowed against DDP (AdamW, fp32): the layouts reduce in
another order (reduce-scatter over dp, all-reduce over tp, sums over pipeline
microbatches); measured differences are below 1e-6."""


@pytest.fixture(scope="module")
def model4(tiny, tmp_path_factory) -> Path:
    """The tiny Llama with 4 layers (2 heads of KV), so pp=2 can hold two stages per rank."""
    from transformers import AutoTokenizer

    from tools.tiny import build_model

    out = tmp_path_factory.mktemp("model4")
    for f in tiny["model"].glob("tok*"):
        shutil.copy(f, out / f.name)
    build_model(out, len(AutoTokenizer.from_pretrained(str(tiny["model"]))), layers=4)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel-runs")


def _job(tiny, model4: Path, runs: Path, name: str, **sections: dict[str, Any]) -> Path:
    data = base_job(tiny, runs, name)
    data["model"]["path"] = str(model4)
    data["train"].update({"max_steps": STEPS, "eval_every": 4, "micro_batch_size": 4})
    data["checkpoint"] = {"every_steps": 4, "keep_last": 2}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = runs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(path: Path, nproc: int, *overrides: str) -> None:
    args = ["-m", "trainer", "run", str(path)]
    for o in overrides:
        args += ["--set", o]
    res = torchrun(args, nproc=nproc, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def _steps(runs: Path, name: str) -> list[dict[str, Any]]:
    steps, wasted = lineage(read_records(resolve(str(runs)).join(name, "metrics.jsonl")))
    assert wasted == 0
    return steps


def _start(runs: Path, name: str) -> dict[str, Any]:
    """The run's first `start` record: what its MFU counted."""
    records = read_records(resolve(str(runs)).join(name, "metrics.jsonl"))
    return next(r for r in records if r.get("event") == "start")


def _assert_same_curve(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "eval_loss"):
        a = [r.get(key) for r in got]
        b = [r.get(key) for r in ref]
        assert [x is None for x in a] == [x is None for x in b], key
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True) if x is not None)
        assert worst <= LOSS_TOL, (key, a, b)


def _export_reproduces_probe(run: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    folder = run / "export" / f"step_{STEPS:08d}" / "model"
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    probe = json.loads((run / "final_probe.json").read_text())
    with torch.no_grad():
        got = model(input_ids=torch.tensor(probe["input_ids"])).logits
    assert torch.allclose(got, torch.tensor(probe["logits"]), atol=1e-5)
    return sorted(p.name for p in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def ddp_curve(tiny, model4, runs) -> list[dict[str, Any]]:
    # 2 workers × 2 rows: the same global batch of 4 as every layout below.
    _train(_job(tiny, model4, runs, "ddp", train={"micro_batch_size": 2}), 2)
    return _steps(runs, "ddp")


def test_tensor_parallel_matches_ddp_and_exports(tiny, model4, runs, ddp_curve):
    _train(_job(tiny, model4, runs, "tp2", strategy={"name": "fsdp", "tp": 2}), 2)
    _assert_same_curve(_steps(runs, "tp2"), ddp_curve)
    assert _export_reproduces_probe(runs / "tp2") == ["model.safetensors"]
    # MFU counts the whole model: a tensor-parallel shard counts whole.
    assert _start(runs, "tp2")["params"] == _start(runs, "ddp")["params"] > 0


def test_interleaved_pipeline_matches_ddp_and_exports_a_shard_per_stage(
    tiny, model4, runs, ddp_curve
):
    strategy = {"name": "fsdp", "pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2}
    _train(_job(tiny, model4, runs, "pp2", strategy=strategy), 2)
    _assert_same_curve(_steps(runs, "pp2"), ddp_curve)
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3: one shard per pipeline rank.
    # MFU counts the whole model: every pipeline stage, not rank 0's.
    assert _start(runs, "pp2")["params"] == _start(runs, "ddp")["params"] > 0
    shards = _export_reproduces_probe(runs / "pp2")
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    state = json.loads((runs / "pp2" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())
    assert state["layout"] == "dcp/2" and state["world_size"] == 2


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_one_worker_accumulating_evaluates_the_same_blocks_as_two(tiny, model4, runs, ddp_curve):
    """The same job on one worker (grad_accum 2 instead of 2 workers): the same losses, and
    the same eval set (train.eval_blocks), so eval_loss agrees to float noise; eval sets
    that counted batches per worker differed here by half the blocks."""
    _train(_job(tiny, model4, runs, "ddp1", train={"micro_batch_size": 2}), 1)
    _assert_same_curve(_steps(runs, "ddp1"), ddp_curve)
    assert _start(runs, "ddp1")["world_size"] == 1
    assert _start(runs, "ddp1")["params"] == _start(runs, "ddp")["params"]


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_checkpoint_of_one_layout_resumes_under_another(tiny, model4, runs, ddp_curve):
    """dp=2 × tp=2 trains steps 1-4 and checkpoints; dp=2 × pp=2 (1F1B) resumes from it
    and trains 5-8: the curve over both is DDP's."""
    path = _job(
        tiny,
        model4,
        runs,
        "switch",
        strategy={"name": "fsdp", "tp": 2},
        train={"micro_batch_size": 2},
        scaling={"num_workers": 4},
    )
    _train(path, 4, "train.stop_at_step=4")
    _train(path, 4, "strategy.tp=1", "strategy.pp=2", "strategy.microbatches=2")
    records = read_records(resolve(str(runs)).join("switch", "metrics.jsonl"))
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [4]
    _assert_same_curve(_steps(runs, "switch"), ddp_curve)
    _export_reproduces_probe(runs / "switch")


def _fsdp(model_dir: Path, tokens: Path, **strategy: Any) -> Any:
    from trainer.config import JobConfig
    from trainer.model.loading import load_tokenizer
    from trainer.strategies.base import ModelSource, build_strategy

    world = strategy.pop("world", 1)
    cfg = JobConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "strategy": {"name": "fsdp", **strategy},
            "scaling": {"num_workers": world},
            "run": {"name": "legacy"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), 0, world)
    if world == 1:
        s.setup(ModelSource(model_dir, len(load_tokenizer(model_dir, str(tokens)))))
    return s


def test_plain_fsdp_still_loads_dcp1_and_model_parallel_refuses_it(tiny, tmp_path):
    """A dcp/1 resume state (nested optimizer state, as FSDP wrote it before dcp/2) loads
    into plain FSDP exactly; a tp/pp job refuses it naming both layouts."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.errors import CheckpointError

    try:
        a = _fsdp(tiny["model"], tiny["tokens"])
        x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        a.train_micro(x, x, 30)
        a.step()
        msd, osd = get_state_dict(a.model, a.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
        b = _fsdp(tiny["model"], tiny["tokens"])
        b.load_state(tmp_path, 0)
        for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor()), n
            sa, sb = a.optimizer.state[p], b.optimizer.state[q]
            assert torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor()), n
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tp = _fsdp(tiny["model"], tiny["tokens"], tp=2, world=2)
    with pytest.raises(CheckpointError, match=r"layout dcp/1 .* needs dcp/2"):
        tp.load_state(tmp_path, 0)
