"""The baseline for the overhead benchmark: the smallest correct DDP loop over the same
packed blocks (no config, checkpoints, metrics or scheduler bookkeeping). Run with torchrun.

    torchrun --nproc_per_node 2 bare_ddp.py MODEL_DIR TOKEN_CACHE_DIR BLOCK MICRO STEPS OUT VOCAB

The tokens come from Raylift's token cache through its own reader
(trainer.data.tokenize.TokenCache), so the baseline follows the cache's layout instead of
hard-coding a file name.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from trainer.data.tokenize import TokenCache


def main() -> None:
    model_dir, cache_dir, block, micro, steps, out, vocab = sys.argv[1:8]
    block, micro, steps = int(block), int(micro), int(steps)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TokenCache(Path(cache_dir)).tokens()
    n_blocks = len(data) // block
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(int(vocab), mean_resizing=False)  # the special tokens
    model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    order = np.random.default_rng(0).permutation(n_blocks)
    times, stamps = [], []  # seconds per step; wall clock after each step
    for step in range(steps):
        t0 = time.perf_counter()
        base = (step * world + rank) * micro
        ix = order[base : base + micro]
        x = torch.from_numpy(
            np.stack([data[i * block : (i + 1) * block] for i in ix]).astype(np.int64)
        )
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        stamps.append(time.time())
    if rank == 0:
        skip = len(times) // 5
        steady = times[skip:]
        tps = world * micro * block * len(steady) / sum(steady)
        # The steady steps' wall-clock span, for the benchmark's CPU accounting.
        window = [stamps[skip - 1] if skip else stamps[0], stamps[-1]]
        with open(out, "w") as f:
            json.dump({"tokens_per_s": tps, "steps": steps, "window": window}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
