"""The merged export written by a sharded strategy is checked like DDP's: on 2 spawned gloo
ranks (no Ray), FSDP2 with LoRA, FSDP2 with QLoRA (torchao NF4 base) and ZeRO-3 with LoRA
gather the adapter, rank 0 merges it into the full-precision base and `finish_export`
loads the folder back: its logits match base + adapter within fp32's 1e-5, and the
adapter moves them far beyond that (so the check can tell). For QLoRA the reference is
the full-precision base, not the NF4 one the adapter trained on, and the check says so.
The module stays light: spawn imports it in each rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

WORLD = 2
CASES = {
    "fsdp-lora": ("fsdp", "lora"),
    "fsdp-qlora": ("fsdp", "qlora"),
    "zero3-lora": ("zero3", "lora"),
}


def _cfg(model_dir: str, strategy: str, adapter: str):
    from trainer.config import load_config

    zero3 = {"name": "deepspeed", "config": "zero3"}
    section = zero3 if strategy == "zero3" else {"name": strategy}
    return load_config(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": {"merge_on_export": True}},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "strategy": section,
            "scaling": {"num_workers": WORLD},
            "run": {"name": "export-sharded"},
        }
    )


def _move_adapter(strategy, name: str) -> None:
    """lora_B starts at zero, which makes any merge, right or wrong, equal the base: give
    it values far from zero, on whatever each rank holds of it."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in strategy.model.named_parameters():
            if "lora_B" not in n:
                continue
            if name == "zero3":
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=gen) * 0.5)


def _two_ranks(rank: int, store: str, model_dir: str, root: str) -> None:
    import torch.distributed as dist

    from trainer.checkpoint.export_check import finish_export
    from trainer.model.loading import load_tokenizer
    from trainer.strategies.base import ModelSource, build_strategy

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    tokenizer = load_tokenizer(Path(model_dir), None)
    for case, (name, adapter) in CASES.items():
        cfg = _cfg(model_dir, name, adapter)
        strategy = build_strategy(cfg, torch.device("cpu"), rank, WORLD)
        strategy.setup(ModelSource(Path(model_dir), len(tokenizer)))
        _move_adapter(strategy, name)
        out = Path(root) / case
        out.mkdir(parents=True, exist_ok=True)
        if strategy.export(out, rank, tokenizer) and rank == 0:
            finish_export(out, Path(model_dir), cfg, tokenizer)
        dist.barrier()
        del strategy
    dist.destroy_process_group()


def test_fsdp2_qlora_and_zero3_merged_exports_match_base_plus_adapter(tiny, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export_check import CHECKS_FILE, compare, fixed_batch, logits_of
    from trainer.model.loading import load_tokenizer

    model_dir = tiny["model"]
    mp.start_processes(
        _two_ranks,
        args=(str(tmp_path / "store"), str(model_dir), str(tmp_path)),
        nprocs=WORLD,
        start_method="spawn",
        join=True,
    )
    ids = fixed_batch(len(load_tokenizer(model_dir, None)))
    base = logits_of(AutoModelForCausalLM.from_pretrained(str(model_dir)), ids)
    for case, (_, adapter) in CASES.items():
        (entry,) = json.loads((tmp_path / case / CHECKS_FILE).read_text())["checks"]
        assert entry["export"] == "model_merged" and entry["passed"], (case, entry)
        assert entry["rel_error"] <= entry["tolerance"] == 1e-5, (case, entry)
        if adapter == "qlora":
            assert "full-precision base" in entry["reference"], entry
        merged_dir = tmp_path / case / "model_merged"
        merged = logits_of(AutoModelForCausalLM.from_pretrained(str(merged_dir)), ids)
        assert compare(case, "base", merged, base, 1e-5).rel_error > 1e-2, case
