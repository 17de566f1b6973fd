"""KTO on 2 workers is the same step as one process, under DDP, FSDP2 and ZeRO-3: two
spawned gloo ranks, each with half the rows, run the real strategy and the KTO objective
(its inputs, its loss with the KL estimate z0 averaged over both ranks, the strategy's
gradient reduction), and the ranks' mean loss, every whole gradient and TRL's metrics
match one process holding all the rows, within 1e-5. Full fine-tuning with a precomputed
reference column, and LoRA (its B matrices set apart from 0 through each strategy's own
parameter layout). No Ray; the module stays light, since spawn imports it in each rank.
(TRL parity of the one-process loss: test_kto_trl.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

VOCAB, BLOCK = 64, 20
LABELS = [True, False, True, False]  # rank 0 gets rows 0-1, rank 1 rows 2-3
ADAPTERS = ("none", "lora")
CASES = [(s, a) for s in ("ddp", "fsdp", "zero3") for a in ADAPTERS]


def _cfg(model_dir: str, strategy: str, adapter: str, workers: int):
    from trainer.config import load_config

    strat = {"name": "deepspeed", "config": "zero3"} if strategy == "zero3" else {"name": strategy}
    return load_config(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": {"r": 4, "alpha": 8}},
            "strategy": strat,
            "data": {"train_file": "unused.jsonl", "block_size": BLOCK},
            "train": {"objective": "kto", "micro_batch_size": 2, "max_steps": 1},
            "scaling": {"num_workers": workers},
            "run": {"name": "kto-ddp"},
        }
    )


def _rows(rows: list[int]) -> tuple[np.ndarray, ...]:
    """A micro batch as the KTO feed gathers it: the rows' sequences, then their
    mismatched ones (prompt i, completion i-1), labels, a reference column, the labels.
    Drawn from one fixed generator, so every process holds the same rows."""
    g = np.random.default_rng(3)
    n = len(LABELS)
    prompts = [g.integers(1, VOCAB, int(g.integers(3, 8))) for _ in range(n)]
    answers = [g.integers(1, VOCAB, int(g.integers(2, 9))) for _ in range(n)]
    reference = g.normal(-40.0, 3.0, 2 * n)
    reference[n + n // 2 :] += 15.0  # rank 1's mismatched rows: a KL estimate of its own
    ids = np.zeros((2 * n, BLOCK), dtype=np.int64)
    labels = np.full((2 * n, BLOCK), -100, dtype=np.int64)
    for shift in (0, 1):
        for i in range(n):
            seq = np.concatenate([prompts[i], answers[(i - shift) % n]])
            ids[shift * n + i, : len(seq)] = seq
            labels[shift * n + i, len(prompts[i]) : len(seq)] = seq[len(prompts[i]) :]
    pick = np.array(rows + [n + i for i in rows])
    return ids[pick], labels[pick], reference[pick], np.array(LABELS)[rows]


def _lora_b_apart_from_zero(strategy) -> None:
    """B starts at 0 (the adapter's policy is its base's): the same random B on every
    process, written through the strategy's layout (FSDP2's shards, ZeRO-3's partitions)."""
    from trainer.rollouts.generate import unwrap

    for name, p in unwrap(strategy.model).named_parameters():
        if "lora_B" not in name:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            if hasattr(p, "ds_id"):
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.copy_(full)
            elif hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)


def _step(model_dir: str, case: tuple[str, str], rank: int, world: int, all_reduce) -> dict:
    """One micro batch through the strategy: this rank's share of the rows, the loop's
    divisor (the step's rows over the world), the whole gradients after its reduction."""
    from tests.support.rl_oracle_worker import full_grads
    from trainer.strategies.base import ModelSource, build_strategy

    name, adapter = case
    torch.manual_seed(0)  # LoRA's A matrices: the same on every process
    cfg = _cfg(model_dir, name, adapter, world)
    strategy = build_strategy(cfg, torch.device("cpu"), rank, world)
    strategy.setup(ModelSource(Path(model_dir), VOCAB))
    strategy.model.train()
    if adapter == "lora":  # B starts at 0: give the adapter a policy apart from its base
        _lora_b_apart_from_zero(strategy)
    share = len(LABELS) // world
    batch = _rows(list(range(rank * share, (rank + 1) * share)))
    objective = strategy.objective
    x, y, kw = objective.inputs(batch, torch.device("cpu"))
    # the loop's divisor: the step's rows (summed over ranks) over the world, here a share
    num_items = torch.tensor(float(objective.count(batch) * world) / world)
    loss = float(strategy.train_micro(x, y, num_items, **kw))
    grads = {n: g.flatten().tolist() for n, g in full_grads(strategy).items()}
    return {"loss": loss, "grads": grads, "metrics": objective.metrics(all_reduce)}


def _two_ranks(rank: int, store: str, model_dir: str, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # ZeRO-3's Init
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def all_reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    got = {"/".join(c): _step(model_dir, c, rank, 2, all_reduce) for c in CASES}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    dist.destroy_process_group()


def _close(a: list[float], b: list[float], rel: float = 1e-5, case: str = "") -> None:
    a_, b_ = np.asarray(a), np.asarray(b)
    scale = max(float(np.abs(b_).max()), 1e-12)
    assert float(np.abs(a_ - b_).max()) <= rel * scale, (case, a_[:4], b_[:4])


def test_kto_on_two_ranks_matches_one_process_under_each_strategy(tmp_path: Path) -> None:
    from tests.support.small_model import tiny_llama

    tiny_llama(0, VOCAB).save_pretrained(str(tmp_path / "model"))
    model_dir, out = str(tmp_path / "model"), str(tmp_path / "ranks")
    mp.start_processes(
        _two_ranks,
        args=(str(tmp_path / "store"), model_dir, out),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for adapter in ADAPTERS:
        one = _step(model_dir, ("ddp", adapter), 0, 1, lambda values: values)
        assert one["grads"], adapter
        if adapter == "lora":
            assert all("lora_" in n for n in one["grads"])
            assert any(max(map(abs, g)) > 0 for n, g in one["grads"].items() if "lora_A" in n)
        assert one["metrics"]["kl"] > 0, adapter  # z0 is live, not clamped away
        for name in ("ddp", "fsdp", "zero3"):
            case = f"{name}/{adapter}"
            two = [r[case] for r in ranks]
            mean = (two[0]["loss"] + two[1]["loss"]) / 2  # each rank's share of the loss
            assert abs(mean - one["loss"]) <= 1e-5 * abs(one["loss"]), (case, mean, one)
            assert abs(two[0]["loss"] - two[1]["loss"]) > 1e-3  # the ranks held other rows
            assert two[0]["grads"].keys() == one["grads"].keys(), case
            for pname, want in one["grads"].items():
                for rank in range(2):
                    _close(two[rank]["grads"][pname], want, case=f"{case} {pname}")
            for rank in range(2):
                assert two[rank]["metrics"].keys() == one["metrics"].keys()
                for key, want in one["metrics"].items():
                    got = two[rank]["metrics"][key]
                    assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (case, key)
