"""One strategy, measured on every rank: what it holds (Strategy.state_nbytes), its peak
resident memory above a warmed-up baseline, and its training tokens/s. Run with torchrun;
rank 0 writes the JSON. The strategy is built and driven through the seam exactly as the
loop does (setup, precision, accumulating, backward, step).

    torchrun --nproc_per_node 2 strategy_worker.py JOB_JSON VOCAB STEPS OUT_JSON
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import peft  # noqa: F401  (imported before the baseline, like everything a strategy uses)
import torch
import torch.distributed as dist
import transformers

from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy


def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def warm_up() -> None:
    """Thread pools, allocator arenas and kernels, paid once per process, go below the
    baseline: a throwaway model runs forward and backward first."""
    conf = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    model = transformers.LlamaForCausalLM(conf)
    x = torch.randint(0, 64, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    del model, x
    gc.collect()


def train_step(s, x: torch.Tensor, measure: bool = False) -> dict[str, int] | None:
    with s.accumulating(True):
        with s.precision():
            loss = s.model(input_ids=x, labels=x).loss
        s.backward(loss)
    state = s.state_nbytes() if measure else None  # grads, params and moments all held
    s.step()
    return state


def main() -> None:
    job, vocab, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(json.loads(Path(job).read_text()))
    device = torch.device("cpu")
    if cfg.strategy.name == "deepspeed":
        from trainer.strategies.deepspeed.engine import prepare_environment

        prepare_environment(device)
        import deepspeed  # noqa: F401
    if cfg.model.adapter == "qlora":
        import bitsandbytes  # noqa: F401
    torch.manual_seed(cfg.train.seed)
    warm_up()
    base = proc_status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS

    s = build_strategy(cfg, device, rank, world)
    s.setup(ModelSource(Path(cfg.model.path), vocab))
    s.model.train()
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, vocab, (cfg.train.micro_batch_size, cfg.data.block_size), generator=gen)

    train_step(s, x)  # warm-up: the optimizer state is allocated here
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(s, x)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    state = train_step(s, x, measure=True)
    mine = {**(state or {}), "peak_rss": proc_status("VmHWM:") - base}
    ranks: list[dict[str, int]] = [{} for _ in range(world)]
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        tokens = world * cfg.train.micro_batch_size * cfg.data.block_size * steps
        Path(out).write_text(
            json.dumps({"tokens_per_s": tokens / elapsed, "ranks": ranks, "world": world})
        )
    # Tear down in this order: the all-gather's work is retired (barrier), the strategy's
    # DDP reducer is gone, then the process group. Left to interpreter exit, the reducer
    # held the group's last reference, and its destructor (holding the GIL) waited on gloo's
    # work thread, which waited for the GIL to free the gather's tensors: rank 1 hung.
    dist.barrier()
    del s
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
