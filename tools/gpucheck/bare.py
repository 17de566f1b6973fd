"""gpu-check's bare loops: the same model, data and batch as a Raylift job, trained by the
smallest correct loop of the framework that job uses (DDP, FSDP2's fully_shard, or
DeepSpeed's initialize with the job's resolved config), so that Raylift's tokens/s can be
read against the framework's own (tools/gpucheck/report.py prints the ratio).

No config machinery, checkpoints, metrics or scheduler: load, wrap, then for each step
forward with labels, backward, clip, optimizer step. Runs on every rank of the job's
process group (collective); rank 0's return value is the figure.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

FRAMEWORKS = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "fsdp_ac": "fsdp",
    "zero2": "deepspeed",
    "zero3": "deepspeed",
}
"""The strategies gpu-check compares with a bare loop (full fine-tuning, no offload)."""


def bare_tokens_per_s(cfg: Any, prep: Any, name: str, steps: int = 6) -> float | None:
    """Tokens/s of all ranks over the bare loop's steps after the first (None: no bare
    loop for this strategy)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.data.tokenize import TokenCache
    from trainer.model.loading import load_tokenizer, local_model_dir, local_tokenizer_dir

    framework = FRAMEWORKS.get(name)
    if framework is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpu = cfg.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu and cfg.train.precision == "bf16" else torch.float32
    vocab = len(load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens))
    torch.manual_seed(0)
    block, micro = cfg.data.block_size, cfg.train.micro_batch_size
    data = TokenCache(Path(prep.train_cache)).tokens()
    order = np.random.default_rng(0).permutation(len(data) // block)

    def batch(step: int) -> torch.Tensor:
        base = (step * world + rank) * micro
        ix = order[(base + np.arange(micro)) % len(order)]
        rows = np.stack([data[i * block : (i + 1) * block] for i in ix])
        return torch.from_numpy(rows.astype(np.int64)).to(device)

    ds_config = None
    if framework == "deepspeed":
        from trainer.strategies.deepspeed import config as dsconfig

        raw, where = dsconfig.load(cfg.strategy.config)
        load_dtype = torch.float32  # DeepSpeed keeps fp32 masters and casts itself
    else:
        load_dtype = torch.float32 if framework == "ddp" else dtype
    model = AutoModelForCausalLM.from_pretrained(str(local_model_dir(cfg)), dtype=load_dtype)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    if cfg.model.gradient_checkpointing or name == "fsdp_ac":
        model.gradient_checkpointing_enable()
    model.to(device)
    autocast = gpu and dtype != torch.float32 and framework == "ddp"
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if gpu else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=gpu)
    elif framework == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        net = fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=gpu)
    else:
        from trainer.strategies.deepspeed.engine import prepare_environment

        prepare_environment(device)
        import deepspeed

        deepspeed.init_distributed(dist_backend=cfg.backend, auto_mpi_discovery=False)
        ds_config = dsconfig.resolve(raw, cfg, where, hidden_size=model.config.hidden_size)
        opt0 = torch.optim.AdamW(model.parameters(), lr=1e-5)
        net, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt0, config=ds_config, dist_init_required=False
        )
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x = batch(step)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            loss = net(input_ids=x, labels=x).loss
        if ds_config is not None:
            net.backward(loss)
            net.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss.item()  # the step is done when its loss is known (as Raylift's records it)
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    del net, opt, model
    if gpu:
        torch.cuda.empty_cache()
    return world * micro * block * len(steady) / sum(steady)
