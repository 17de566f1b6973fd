"""What the sequence-parallel exactness tests share (tests/unit/parallel/test_ulysses_*.py):
the two tiny Llamas (2 KV heads for sp 2, 4 for sp 4), the job config of one case, the gloo
world of spawned ranks (no Ray), one micro batch through the real strategy and objective,
and the comparison with one process. Kept light: every spawned rank imports it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 96


def save_models(root: Path) -> Path:
    """`root`/kv2 (4 heads, 2 KV heads: grouped-query) and `root`/kv4 (every head its
    own KV), saved once per test module."""
    from transformers import LlamaForCausalLM

    from tests.support.small_model import tiny_llama

    kv2 = tiny_llama(0, VOCAB)
    kv2.save_pretrained(str(root / "kv2"))
    conf = kv2.config.to_dict() | {"num_key_value_heads": 4}
    torch.manual_seed(1)
    LlamaForCausalLM(type(kv2.config)(**conf)).float().save_pretrained(str(root / "kv4"))
    return root


def job_config(
    model_dir: str,
    strategy: str,
    sp: int,
    adapter: str,
    attention: str,
    world: int,
    block: int,
    rows: int,
    objective: str = "sft",
) -> Any:
    from trainer.config import load_config

    return load_config(
        {
            "model": {
                "path": model_dir,
                "adapter": adapter,
                "attn_implementation": attention,
                "lora": {"r": 4, "alpha": 8},
            },
            "data": {"train_file": "unused.jsonl", "block_size": block},
            "train": {"micro_batch_size": rows, "max_steps": 2, "objective": objective},
            "strategy": {"name": strategy, "sp": sp},
            "scaling": {"num_workers": world},
            "run": {"name": "sp-exact"},
        }
    )


def spawn(worker: Callable[..., None], world: int, *args: Any) -> None:
    """`worker(rank, world, *args)` on `world` spawned processes, joined."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, *args), nprocs=world, start_method="spawn", join=True)


def init_gloo(rank: int, world: int, store: str) -> None:
    """The world's process group; the launcher's variables DeepSpeed's ZeRO-3 init reads."""
    import os

    import torch.distributed as dist

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def build(cfg: Any, model_dir: str, rank: int, world: int) -> Any:
    """The job's real strategy on CPU, its model loaded, in train mode."""
    from trainer.strategies.base import ModelSource, build_strategy

    s = build_strategy(cfg, torch.device("cpu"), rank, world)
    s.setup(ModelSource(Path(model_dir), VOCAB))
    s.model.train()
    return s


def _full(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient: FSDP2's DTensor gathered, ZeRO-3's partition too."""
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(p).reshape(p.ds_shape)
    return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad


def train_micro(s: Any, mine: tuple, attend: Callable[[list], dict], world: int) -> dict:
    """One micro batch (this rank's `mine`) through the strategy's objective (sequence-
    sharded where sp > 1) and backward: the rank's loss, the step report's mean over every
    rank, every trainable parameter's whole gradient, and the shape of the rank's input
    (its share). Collective."""
    import torch.distributed as dist

    objective = s.objective
    total = torch.tensor(float(objective.count(mine)))
    dist.all_reduce(total)  # the loop's divisor: the step's items over every rank
    x, y, kw = objective.inputs(mine, torch.device("cpu"), attend)
    with s.accumulating(True):
        loss = s.train_micro(x, y, total / world, **kw)
    reported = loss.clone()
    dist.all_reduce(reported)
    grads = {
        n.removeprefix("module."): _full(p).tolist()
        for n, p in s.model.named_parameters()
        if p.requires_grad
    }
    s.optimizer.zero_grad()
    return {
        "loss": float(loss),
        "reported": float(reported) / world,
        "grads": grads,
        "shape": list(x.shape),
    }


def write(root: str, world: int, rank: int, out: dict) -> None:
    import torch.distributed as dist

    Path(f"{root}/out.{world}.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def read(root: Path, world: int) -> list[dict]:
    return [json.loads((root / f"out.{world}.{r}.json").read_text()) for r in range(world)]


def assert_matches(
    outs: list[dict],
    name: str,
    one_replica: bool,
    want_loss: float,
    want_grads: dict[str, torch.Tensor],
    tol: float = 1e-5,
) -> None:
    """The step's reported loss and every gradient within `tol` of one process; with one
    replica every rank reports the whole batch's loss; the gradients are not all ~0."""
    got = outs[0][name]
    assert abs(got["reported"] - want_loss) < tol, (name, got["reported"], want_loss)
    if one_replica:
        for o in outs:
            assert abs(o[name]["loss"] - want_loss) < tol, (name, o[name]["loss"], want_loss)
    assert set(got["grads"]) == set(want_grads), name
    for n, g in got["grads"].items():
        diff = (torch.tensor(g) - want_grads[n]).abs().max().item()
        assert diff < tol, (name, n, diff)
    assert max(want_grads[n].abs().max().item() for n in want_grads) > 1e-3, name
