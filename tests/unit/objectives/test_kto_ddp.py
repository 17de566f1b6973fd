"""KTO on DDP with 2 workers is the same step as one process: two spawned gloo ranks, each
with half the rows, run the real DDP strategy and the KTO objective (its inputs, its loss
with the KL estimate z0 averaged over both ranks, DDP's gradient average), and the ranks'
mean loss, every gradient and TRL's metrics match one process holding all the rows,
within 1e-5. Full fine-tuning with a precomputed reference column, and LoRA with the
adapter switched off through DDP's wrapper. No Ray; the module stays light, since spawn
imports it in each rank. (TRL parity of the one-process loss: test_kto_trl.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

VOCAB, BLOCK = 64, 20
LABELS = [True, False, True, False]  # rank 0 gets rows 0-1, rank 1 rows 2-3
ADAPTERS = ("none", "lora")


def _cfg(model_dir: str, adapter: str, workers: int):
    from trainer.config import load_config

    return load_config(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": {"r": 4, "alpha": 8}},
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


def _step(model_dir: str, adapter: str, rank: int, world: int, all_reduce) -> dict:
    """One micro batch through the strategy: this rank's share of the rows, the loop's
    divisor (the step's rows over the world), the gradients after DDP's average."""
    from trainer.strategies.base import ModelSource, build_strategy

    torch.manual_seed(0)  # LoRA's A matrices: the same on every process
    strategy = build_strategy(_cfg(model_dir, adapter, world), torch.device("cpu"), rank, world)
    strategy.setup(ModelSource(Path(model_dir), VOCAB))
    strategy.model.train()
    if adapter == "lora":  # B starts at 0: give the adapter a policy apart from its base
        with torch.no_grad():
            for name, p in strategy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    share = len(LABELS) // world
    batch = _rows(list(range(rank * share, (rank + 1) * share)))
    objective = strategy.objective
    x, y, kw = objective.inputs(batch, torch.device("cpu"))
    # the loop's divisor: the step's rows (summed over ranks) over the world, here a share
    num_items = torch.tensor(float(objective.count(batch) * world) / world)
    loss = float(strategy.train_micro(x, y, num_items, **kw))
    grads = {
        n: p.grad.flatten().tolist()
        for n, p in strategy.hf.named_parameters()
        if p.grad is not None
    }
    return {"loss": loss, "grads": grads, "metrics": objective.metrics(all_reduce)}


def _two_ranks(rank: int, store: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def all_reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    got = {adapter: _step(model_dir, adapter, rank, 2, all_reduce) for adapter in ADAPTERS}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    dist.destroy_process_group()


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    a_, b_ = np.asarray(a), np.asarray(b)
    scale = max(float(np.abs(b_).max()), 1e-12)
    assert float(np.abs(a_ - b_).max()) <= rel * scale, (a_[:4], b_[:4])


def test_kto_on_two_ddp_ranks_matches_one_process(tmp_path: Path) -> None:
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
        one = _step(model_dir, adapter, 0, 1, lambda values: values)
        two = [r[adapter] for r in ranks]
        mean = (two[0]["loss"] + two[1]["loss"]) / 2  # each rank's share of the step's loss
        assert abs(mean - one["loss"]) <= 1e-5 * abs(one["loss"]), (adapter, mean, one["loss"])
        assert abs(two[0]["loss"] - two[1]["loss"]) > 1e-3  # the ranks held different rows
        assert one["grads"].keys() == two[0]["grads"].keys() and one["grads"], adapter
        if adapter == "lora":
            assert all("lora_" in n for n in one["grads"])
        for name, want in one["grads"].items():
            for rank in range(2):
                _close(two[rank]["grads"][name], want)
        assert one["metrics"]["kl"] > 0, adapter  # z0 is live, not clamped away
        for rank in range(2):
            assert two[rank]["metrics"].keys() == one["metrics"].keys()
            for key, want in one["metrics"].items():
                assert abs(two[rank]["metrics"][key] - want) <= 1e-5 * max(abs(want), 1e-3), key
