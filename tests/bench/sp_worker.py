"""One case of the sequence-parallel bench: `python -m tests.bench.sp_worker SP LENGTH
MODEL_DIR` spawns SP gloo ranks (one replica, dp 1) that each build the model through the
real DDP strategy with `strategy.sp: SP`, run one warm-up step (gradients and the
all-to-all's buffers exist from then on), reset their peak RSS (/proc/self/clear_refs 5)
and run one training step of a LENGTH-token sequence. Prints one JSON line: each rank's
peak resident memory above its own before the step (bytes), and the loss."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

VOCAB = 512


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def job(model_dir: str, sp: int, length: int):
    from trainer.config import load_config

    return load_config(
        {
            "model": {"path": model_dir, "attn_implementation": "sdpa"},
            "data": {"train_file": "unused.jsonl", "block_size": length},
            "train": {"micro_batch_size": 1, "max_steps": 2, "loss": "chunked"},
            "strategy": {"name": "ddp", "sp": sp},
            "scaling": {"num_workers": sp},
            "run": {"name": "bench-sp"},
        }
    )


def _rank(rank: int, sp: int, length: int, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.strategies.base import ModelSource, build_strategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=sp)
    cfg = job(model_dir, sp, length)
    s = build_strategy(cfg, torch.device("cpu"), rank, sp)
    s.setup(ModelSource(Path(model_dir), VOCAB))
    s.model.train()
    objective = s.objective
    gen = np.random.default_rng(0)
    ids = gen.integers(0, VOCAB, (1, length), dtype=np.int64)
    batch = (ids, ids.copy())
    total = torch.tensor(float(objective.count(batch)))
    dist.all_reduce(total)

    def step() -> float:
        x, y, kw = objective.inputs(batch, torch.device("cpu"), lambda segs: {})
        with s.accumulating(True):
            loss = s.train_micro(x, y, total / sp, **kw)
        s.optimizer.zero_grad(set_to_none=False)  # keep the gradients' memory: state
        return float(loss)

    step()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _kib("VmRSS")
    loss = step()
    peak = _kib("VmHWM")
    Path(f"{out}.{rank}").write_text(json.dumps({"peak": (peak - base) * 1024, "loss": loss}))
    dist.destroy_process_group()


def main(sp: int, length: int, model_dir: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out"
        mp.start_processes(
            _rank,
            args=(sp, length, model_dir, f"{tmp}/store", out),
            nprocs=sp,
            start_method="spawn",
            join=True,
        )
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(sp)]
    return {"peak_bytes": [r["peak"] for r in ranks], "loss": ranks[0]["loss"]}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])))
