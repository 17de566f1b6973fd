"""The preference loss on every strategy: 2 gloo workers (no Ray), each a half of one batch
of pairs, through the strategy's own train_micro (its precision, backward, gradient
reduction) and step (its global grad norm); before it, each full-weight strategy's own
reference pass over a pair cache, sharded over the 2 ranks, must give a live reference
model's log-probs. The summed loss and the grad norm must equal
one process computing the whole batch (the objective TRL's losses are checked against in
tests/unit/objectives), to 1e-5 relative: DDP, FSDP2, ZeRO-2 and ZeRO-3 against a
precomputed reference column, LoRA on DDP and on FSDP2 and QLoRA on DDP (bitsandbytes'
4-bit base) against the adapter-off reference. KTO the same way on ZeRO-3 (column) and
FSDP2 with LoRA (adapter-off): the batch's rows are KTO rows, the rejected half their
mismatched (KL) sequences, and the KL estimate is averaged across the ranks."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

PAIRS, BLOCK = 4, 16
LAYOUTS = {
    "ddp": ({"name": "ddp"}, "none"),
    "fsdp": ({"name": "fsdp"}, "none"),
    "zero2": ({"name": "deepspeed", "config": "zero2"}, "none"),
    "zero3": ({"name": "deepspeed", "config": "zero3"}, "none"),
    "ddp-lora": ({"name": "ddp"}, "lora"),
    "fsdp-lora": ({"name": "fsdp"}, "lora"),
    "ddp-qlora": ({"name": "ddp"}, "qlora"),
}
KTO_LAYOUTS = {  # KTO's extra no-grad forwards and its cross-rank KL estimate, on the two
    # layouts that shard parameters: ZeRO-3 against the column, FSDP2 with LoRA adapter-off
    "kto-zero3": ({"name": "deepspeed", "config": "zero3"}, "none"),
    "kto-fsdp-lora": ({"name": "fsdp"}, "lora"),
}
DESIRABLE = torch.tensor([True, False, False, True])


def _cfg(model_dir: str, strategy: dict, adapter: str, world: int, objective: str = "dpo"):
    from trainer.config import JobConfig

    return JobConfig.model_validate(
        {
            "model": {"path": model_dir, "adapter": adapter},
            "data": {"train_file": "unused.jsonl", "block_size": BLOCK},
            "strategy": strategy,
            "train": {"objective": objective, "micro_batch_size": PAIRS // world, "max_steps": 1},
            "optim": {"grad_clip": None},
            "scaling": {"num_workers": world},
            "run": {"name": "pref-strategies"},
        }
    )


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, reference log-probs) of PAIRS pairs: chosen rows, then rejected."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (2 * PAIRS, BLOCK), generator=g)
    ids[PAIRS:, :5] = ids[:PAIRS, :5]  # one prompt per pair
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 12:] = -100  # completions of different lengths
    labels[PAIRS + 2, 9:] = -100
    ref = -30 + 5 * torch.rand(2 * PAIRS, generator=g, dtype=torch.float64)
    return ids, labels, ref


def _run(strategy, ids, labels, ref, rows, world):
    """Loss (averaged over ranks, as the step report does: each rank's is its pairs' sum
    over the global pairs / world) and global grad norm of one step on `rows`."""
    import torch.distributed as dist

    if strategy.objective.name == "kto":  # a reference 40 nats below: a live KL estimate
        ref = ref - 40
    column = ref[rows] if strategy.objective.column_reference else None
    kw = (
        {"desirable": DESIRABLE[rows[: len(rows) // 2]]} if strategy.objective.name == "kto" else {}
    )
    with strategy.accumulating(True):
        loss = strategy.train_micro(
            ids[rows], labels[rows], torch.tensor(PAIRS / world), ref=column, **kw
        )
    if world > 1:
        dist.all_reduce(loss)
    return float(loss) / world, float(strategy.step())


def _half(rank: int, world: int) -> torch.Tensor:
    mine = torch.arange(rank, PAIRS, world)
    return torch.cat([mine, mine + PAIRS])


def _worker(
    rank: int, world: int, init: str, model_dir: str, vocab: int, out: str, caches: str
) -> None:
    import torch.distributed as dist

    from trainer.data.tokenize import TokenCache
    from trainer.objectives.pairs import PairBlocks
    from trainer.objectives.reference import ensure_reference
    from trainer.strategies.base import ModelSource, build_strategy

    torch.set_num_threads(1)
    # What torchrun sets, and DeepSpeed's partitioned init reads.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ids, labels, ref = _batch(vocab)
    result = {}
    for name, (strategy_opts, adapter) in LAYOUTS.items():
        torch.manual_seed(0)
        s = build_strategy(
            _cfg(model_dir, strategy_opts, adapter, world), torch.device("cpu"), rank, world
        )
        s.setup(ModelSource(Path(model_dir), vocab))
        s.model.train()
        if adapter == "none":  # the reference pass, sharded over the ranks, before a step
            pairs = PairBlocks(TokenCache(Path(caches) / name), BLOCK)
            rt = SimpleNamespace(
                rank=rank, world_size=world, barrier=dist.barrier, run=SimpleNamespace(uri=out)
            )
            ensure_reference(s.cfg, s, pairs, rt)
            result[f"{name}-reference"] = pairs.reference.tolist()
        result[name] = _run(s, ids, labels, ref, _half(rank, world), world)
        dist.barrier()
        del s
    for name, (strategy_opts, adapter) in KTO_LAYOUTS.items():  # rows, then KL sequences
        torch.manual_seed(0)
        cfg = _cfg(model_dir, strategy_opts, adapter, world, "kto")
        s = build_strategy(cfg, torch.device("cpu"), rank, world)
        s.setup(ModelSource(Path(model_dir), vocab))
        s.model.train()
        result[name] = _run(s, ids, labels, ref, _half(rank, world), world)
        dist.barrier()
        del s
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _single(model_dir: str, vocab: int) -> dict[str, tuple[float, float]]:
    """One process, the whole batch: DDP on a world of one is the plain model."""
    from trainer.strategies.base import ModelSource, build_strategy

    ids, labels, ref = _batch(vocab)
    out = {}
    for objective, adapter in [(o, a) for o in ("dpo", "kto") for a in ("none", "lora", "qlora")]:
        if objective == "kto" and adapter == "qlora":
            continue
        torch.manual_seed(0)
        cfg = _cfg(model_dir, {"name": "ddp"}, adapter, 1, objective)
        s = build_strategy(cfg, torch.device("cpu"), 0, 1)
        s.setup(ModelSource(Path(model_dir), vocab))
        s.model.train()
        key = adapter if objective == "dpo" else f"kto-{adapter}"
        out[key] = _run(s, ids, labels, ref, torch.arange(2 * PAIRS), 1)
    return out


def _pair_caches(tiny, tmp: Path) -> tuple[Path, torch.Tensor]:
    """A pair cache per full-weight layout (each computes its own reference pass), and the
    log-probs a live reference model gives its sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.preference import write_pairs
    from trainer.data.tokenize import Settings, prepare
    from trainer.objectives.losses import sequence_logps
    from trainer.objectives.pairs import PairBlocks, data_options

    model_dir = str(tiny["model"])
    cfg = _cfg(model_dir, {"name": "ddp"}, "none", 2)
    opts = data_options(cfg, Settings(block_size=BLOCK))
    rows = write_pairs(tmp / "pairs.jsonl", 7)  # odd: the last batch is padded
    cache = prepare(str(rows), AutoTokenizer.from_pretrained(model_dir), cache_root=str(tmp),
                    progress=False, **opts)  # fmt: skip
    root = tmp / "per-layout"
    for name, (_, adapter) in LAYOUTS.items():
        if adapter == "none":
            shutil.copytree(cache.dir, root / name)
    blocks = PairBlocks(cache, BLOCK).blocks
    ids, labels = (torch.from_numpy(a) for a in blocks.gather(np.arange(len(blocks))))
    live = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        return root, sequence_logps(live(input_ids=ids).logits, labels)[0].double()


def test_preference_loss_and_grads_on_every_strategy(tiny, tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    from transformers import AutoTokenizer

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model_dir = str(tiny["model"])
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    out = tmp_path / "losses.json"
    caches, live = _pair_caches(tiny, tmp_path)
    init = tempfile.mktemp(prefix="pg-", dir=tmp_path)
    mp.spawn(_worker, args=(2, init, model_dir, vocab, str(out), str(caches)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    for name, (_, adapter) in LAYOUTS.items():
        if adapter == "none":  # each strategy's reference pass gives the live model's
            torch.testing.assert_close(
                torch.tensor(got[f"{name}-reference"], dtype=torch.float64), live, rtol=1e-5, atol=0
            )
    single = _single(model_dir, vocab)
    assert single["none"][0] != pytest.approx(single["lora"][0])  # the reference matters
    for name, (_, adapter) in LAYOUTS.items():
        want_loss, want_norm = single[adapter]
        loss, norm = got[name]
        assert loss == pytest.approx(want_loss, rel=1e-5), name
        assert norm == pytest.approx(want_norm, rel=1e-5), name
    # KTO: each rank a half of the rows, its KL estimate over both ranks' mismatched rows
    assert single["kto-none"][0] != pytest.approx(single["kto-lora"][0])
    for name, (_, adapter) in KTO_LAYOUTS.items():
        want_loss, want_norm = single[f"kto-{adapter}"]
        loss, norm = got[name]
        assert loss == pytest.approx(want_loss, rel=1e-5), name
        assert norm == pytest.approx(want_norm, rel=1e-5), name
