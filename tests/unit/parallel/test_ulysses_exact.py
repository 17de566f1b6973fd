"""Sequence parallelism (trainer.parallel.sequence) is exact: on spawned gloo ranks (no
Ray), through the real strategies (DDP, FSDP2, LoRA) and the real SFT objective, the loss
the step reports and every gradient match one process running the whole global batch,
within 1e-5: sp 2 on 2 ranks (dp 1) and sp 2 on 4 ranks (dp 2 × sp 2), sp 4 on 4 ranks,
plain causal (sdpa and eager), packed documents (the block mask and restarted positions
carried across the split) and LoRA. The module stays light: spawn imports it per rank."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

VOCAB = 96
BLOCK = 16
ROWS = 2  # micro batch per replica

CASES_2 = [  # (name, strategy, sp, adapter, packed, attention, model)
    ("ddp_eager", "ddp", 2, "none", False, "eager", "kv2"),
    ("fsdp", "fsdp", 2, "none", False, "sdpa", "kv2"),
    ("fsdp_lora", "fsdp", 2, "lora", False, "sdpa", "kv2"),
    ("fsdp_packed", "fsdp", 2, "none", True, "sdpa", "kv2"),
]
CASES_4 = [
    ("fsdp_dp2", "fsdp", 2, "none", True, "sdpa", "kv2"),
    ("ddp_sp4", "ddp", 4, "none", False, "sdpa", "kv4"),
    ("fsdp_lora_sp4", "fsdp", 4, "lora", True, "eager", "kv4"),
]


def _cfg(model_dir: str, strategy: str, sp: int, adapter: str, attention: str, world: int):
    from trainer.config import load_config

    return load_config(
        {
            "model": {
                "path": model_dir,
                "adapter": adapter,
                "attn_implementation": attention,
                "lora": {"r": 4, "alpha": 8},
            },
            "data": {"train_file": "unused.jsonl", "block_size": BLOCK},
            "train": {"micro_batch_size": ROWS, "max_steps": 2},
            "strategy": {"name": strategy, "sp": sp},
            "scaling": {"num_workers": world},
            "run": {"name": "sp-exact"},
        }
    )


def _global_batch(replicas: int, packed: bool) -> tuple[np.ndarray, ...]:
    """Every replica's rows, in replica order; prompts masked; packed: three documents a
    row, their boundaries off the share boundary (BLOCK / 2) and on it."""
    gen = np.random.default_rng(7)
    n = ROWS * replicas
    ids = gen.integers(0, VOCAB, (n, BLOCK), dtype=np.int64)
    labels = ids.copy()
    labels[:, :3] = -100
    labels[0, 9:11] = -100
    if not packed:
        return ids, labels
    segs = np.zeros((n, BLOCK), dtype=np.int32)
    for r in range(n):
        cut1, cut2 = (5, 11) if r % 2 == 0 else (8, 13)  # 8 = the share boundary at sp 2
        segs[r, cut1:] = 1
        segs[r, cut2:] = 2
    return ids, labels, segs


def _attend(impl: str, segs: list[np.ndarray]) -> dict:
    from trainer.data import packing

    if not segs:
        return {}
    return packing.attention_inputs(torch.from_numpy(segs[0]), impl)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ranks(rank: int, world: int, store: str, root: str, cases: list) -> None:
    import torch.distributed as dist

    from trainer.strategies.base import ModelSource, build_strategy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = {}
    for name, strategy, sp, adapter, packed, attention, model in cases:
        model_dir = f"{root}/{model}"
        cfg = _cfg(model_dir, strategy, sp, adapter, attention, world)
        s = build_strategy(cfg, torch.device("cpu"), rank, world)
        s.setup(ModelSource(Path(model_dir), VOCAB))
        s.model.train()
        objective = s.objective
        replica, _ = cfg.data_rank(rank, world)
        batch = _global_batch(world // sp, packed)
        mine = tuple(a[replica * ROWS : (replica + 1) * ROWS] for a in batch)
        total = torch.tensor(float(objective.count(mine)))
        dist.all_reduce(total)
        x, y, kw = objective.inputs(
            mine, torch.device("cpu"), functools.partial(_attend, attention)
        )
        assert x.shape == (ROWS, BLOCK // sp)
        with s.accumulating(True):
            loss = s.train_micro(x, y, total / world, **kw)
        reported = loss.clone()
        dist.all_reduce(reported)  # the step report: the mean over every rank
        grads = {
            n.removeprefix("module."): _full(p.grad).tolist()
            for n, p in s.model.named_parameters()
            if p.requires_grad
        }
        out[name] = {"loss": float(loss), "reported": float(reported) / world, "grads": grads}
        s.optimizer.zero_grad()
        del s
    Path(f"{root}/out.{world}.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _reference(root: Path, case: tuple, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole global batch: the mean loss and every gradient."""
    from transformers import AutoModelForCausalLM

    from trainer.model import adapters
    from trainer.objectives.sft import SFT

    _name, strategy, sp, adapter, packed, attention, model = case
    cfg = _cfg(str(root / model), strategy, 1, adapter, attention, world)
    one = AutoModelForCausalLM.from_pretrained(
        str(root / model), dtype=torch.float32, attn_implementation=attention
    )
    if adapter != "none":
        one = adapters.apply(one, cfg, False)
    one.train()
    ids, labels, *segs = _global_batch(world // sp, packed)
    kw = _attend(attention, segs)
    loss = SFT(cfg).loss(one, torch.from_numpy(ids), torch.from_numpy(labels), None, **kw)
    loss.backward()
    grads = {n: p.grad for n, p in one.named_parameters() if p.requires_grad}
    return float(loss), grads


def _check(root: Path, world: int, cases: list) -> None:
    outs = [json.loads((root / f"out.{world}.{r}.json").read_text()) for r in range(world)]
    for case in cases:
        name, sp = case[0], case[2]
        want_loss, want_grads = _reference(root, case, world)
        got = outs[0][name]
        assert abs(got["reported"] - want_loss) < 1e-5, (name, got["reported"], want_loss)
        if world == sp:  # one replica: every rank reports the whole sequence's loss
            for o in outs:
                assert abs(o[name]["loss"] - want_loss) < 1e-5, (name, o[name]["loss"])
        assert set(got["grads"]) == set(want_grads), name
        for n, g in got["grads"].items():
            diff = (torch.tensor(g) - want_grads[n]).abs().max().item()
            assert diff < 1e-5, (name, n, diff)
        assert max(want_grads[n].abs().max().item() for n in want_grads) > 1e-3, name


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    from tests.support.small_model import tiny_llama

    root = tmp_path_factory.mktemp("sp")
    kv2 = tiny_llama(0, VOCAB)  # 4 heads, 2 KV heads (grouped-query)
    kv2.save_pretrained(str(root / "kv2"))
    conf = kv2.config.to_dict() | {"num_key_value_heads": 4}  # every head its own KV
    torch.manual_seed(1)
    LlamaForCausalLM(type(kv2.config)(**conf)).float().save_pretrained(str(root / "kv4"))
    return root


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_sequence_parallel_matches_one_process(models: Path, world: int, cases: list) -> None:
    mp.start_processes(
        _ranks,
        args=(world, str(models / f"store{world}"), str(models), cases),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    _check(models, world, cases)
