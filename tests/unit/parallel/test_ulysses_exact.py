"""Sequence parallelism (trainer.parallel.sequence) is exact: on spawned gloo ranks (no
Ray), through the real strategies (DDP, FSDP2, LoRA) and the real SFT objective, the loss
the step reports and every gradient match one process running the whole global batch,
within 1e-5: sp 2 on 2 ranks (dp 1) and sp 2 on 4 ranks (dp 2 × sp 2), sp 4 on 4 ranks,
plain causal (sdpa and eager), packed documents (the block mask and restarted positions
carried across the split) and LoRA. The module stays light: spawn imports it per rank."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import sp_exact

VOCAB = sp_exact.VOCAB
BLOCK = 16
ROWS = 2  # micro batch per replica

CASES_2 = [  # (name, strategy, sp, adapter, packed, attention, model)
    ("ddp_eager", "ddp", 2, "none", False, "eager", "kv2"),
    ("fsdp", "fsdp", 2, "none", False, "sdpa", "kv2"),
    ("fsdp_lora", "fsdp", 2, "lora", False, "sdpa", "kv2"),
    ("fsdp_packed", "fsdp", 2, "none", True, "sdpa", "kv2"),
    ("zero3", "deepspeed", 2, "none", False, "sdpa", "kv2"),
]
CASES_4 = [
    ("fsdp_dp2", "fsdp", 2, "none", True, "sdpa", "kv2"),
    ("ddp_sp4", "ddp", 4, "none", False, "sdpa", "kv4"),
    ("fsdp_lora_sp4", "fsdp", 4, "lora", True, "eager", "kv4"),
]


def _cfg(model_dir: str, strategy: str, sp: int, adapter: str, attention: str, world: int):
    return sp_exact.job_config(model_dir, strategy, sp, adapter, attention, world, BLOCK, ROWS)


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


def _ranks(rank: int, world: int, store: str, root: str, cases: list) -> None:
    sp_exact.init_gloo(rank, world, store)
    out = {}
    for name, strategy, sp, adapter, packed, attention, model in cases:
        model_dir = f"{root}/{model}"
        cfg = _cfg(model_dir, strategy, sp, adapter, attention, world)
        s = sp_exact.build(cfg, model_dir, rank, world)
        replica, _ = cfg.data_rank(rank, world)
        batch = _global_batch(world // sp, packed)
        mine = tuple(a[replica * ROWS : (replica + 1) * ROWS] for a in batch)
        out[name] = sp_exact.train_micro(s, mine, functools.partial(_attend, attention), world)
        assert out[name]["shape"] == [ROWS, BLOCK // sp], name
        del s
    sp_exact.write(root, world, rank, out)


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
    outs = sp_exact.read(root, world)
    for case in cases:
        want_loss, want_grads = _reference(root, case, world)
        sp_exact.assert_matches(outs, case[0], world == case[2], want_loss, want_grads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return sp_exact.save_models(tmp_path_factory.mktemp("sp"))


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_sequence_parallel_matches_one_process(models: Path, world: int, cases: list) -> None:
    sp_exact.spawn(_ranks, world, str(models / f"store{world}"), str(models), cases)
    _check(models, world, cases)
