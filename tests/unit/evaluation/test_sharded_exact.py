"""The loop's benchmark evaluator scores exactly as lm-eval does in one process.

A tiny Llama (its own tokenizer) on two local task YAMLs, each reading a few jsonl rows
the test writes: a multiple-choice task (log-likelihood passes) and a generative one
(greedy `generate` cut at a stop string). On 2 spawned gloo ranks (no Ray) the model is
held by DDP, FSDP2 and ZeRO-3 (DS_ACCELERATOR=cpu) and scored through
`trainer.evaluation.sharded.ShardedLM`, the requests split over the ranks and gathered back
in request order. `lm_eval.simple_evaluate` on the model folder with lm-eval's own HF model,
in one process, is the reference: the same accuracy, every choice's log-likelihood within
1e-5, the same generations. The module stays light: spawn imports it in each rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.multiprocessing as mp

from tests.support.eval_tasks import GEN, MC, write_model_and_tasks

WORLD = 2
TOL = 1e-5
# ZeRO-3 last: its partitioned init leaves torch's F.linear patched in the process.
STRATEGIES = ("ddp", "fsdp", "zero3")


def _cfg(model_dir: str, strategy: str):
    from trainer.config import load_config

    section = (
        {"name": "deepspeed", "config": "zero3"} if strategy == "zero3" else {"name": strategy}
    )
    return load_config(
        {
            "model": {"path": model_dir},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "strategy": section,
            "scaling": {"num_workers": WORLD},
            "run": {"name": "eval-exact"},
        }
    )


def _summary(results: dict) -> dict:
    """Per task: its metrics, each example's responses (log-likelihoods or texts)."""
    out = {}
    for task in (MC, GEN):
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = {
            "metrics": {k: v for k, v in results["results"][task].items() if "," in k},
            "resps": [[r[0] for r in s["resps"]] for s in samples],
        }
    return out


def _ranks(rank: int, store: str, model_dir: str, specs: list[str], out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trainer.evaluation.sharded import ShardedLM
    from trainer.evaluation.tasks import evaluate
    from trainer.strategies.base import ModelSource, build_strategy

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    tok = AutoTokenizer.from_pretrained(model_dir)
    got = {}
    for name in STRATEGIES:
        s = build_strategy(_cfg(model_dir, name), torch.device("cpu"), rank, WORLD)
        s.setup(ModelSource(Path(model_dir), len(tok)))
        s.model.train()
        with s.evaluating():
            lm = ShardedLM(s, tok, torch.device("cpu"), rank=rank, world=WORLD, batch_size=3)
            results = evaluate(lm, specs, log_samples=True)
        if rank == 0:
            got[name] = _summary(results)
        assert s.model.training  # back to train mode for the next step
        dist.barrier()
        del s
        gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_scores_match_lm_eval_in_one_process(tmp_path, monkeypatch):
    from trainer.evaluation.tasks import evaluate

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    model, specs = write_model_and_tasks(tmp_path)
    want = _summary(
        evaluate(
            _hf_reference(model),
            specs,
            log_samples=True,
        )
    )
    mc = want[MC]
    assert len(mc["resps"]) == 7 and {len(r) for r in mc["resps"]} == {3, 4}
    assert 0.0 <= mc["metrics"]["acc,none"] <= 1.0
    assert all(isinstance(r[0], str) for r in want[GEN]["resps"])

    out = tmp_path / "got.json"
    mp.start_processes(
        _ranks,
        args=(str(tmp_path / "store"), str(model), specs, str(out)),
        nprocs=WORLD,
        start_method="spawn",
        join=True,
    )
    got = json.loads(out.read_text())
    for name in STRATEGIES:
        case = got[name]
        assert case[MC]["metrics"] == mc["metrics"], name
        for doc, (have, ref) in enumerate(zip(case[MC]["resps"], mc["resps"], strict=True)):
            assert len(have) == len(ref), (name, doc)
            for (ll, greedy), (ll_ref, greedy_ref) in zip(have, ref, strict=True):
                assert abs(ll - ll_ref) < TOL, (name, doc, ll, ll_ref)
                assert greedy == greedy_ref, (name, doc)
        assert case[GEN]["resps"] == want[GEN]["resps"], name
        assert case[GEN]["metrics"] == want[GEN]["metrics"], name


def _hf_reference(model: Path):
    """lm-eval's own HF model on the folder, fp32 on CPU, batch 1."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model), dtype="float32", device="cpu", batch_size=1)
