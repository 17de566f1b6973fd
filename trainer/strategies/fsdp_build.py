"""Building one FSDP2 part of the model (the whole model, or one pipeline stage): a
skeleton on the meta device, the adapter and its NF4 base, the pipeline cut, the tp split,
fully_shard over dp, then the part materialised and filled from the memory-mapped
safetensors with only this rank's shards. Its own module because it is one long recipe
whose order matters (trainer.strategies.fsdp says why each step is where it is), apart
from the strategy's steps, resume state and export.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import FSDPOptions, JobConfig
from trainer.errors import UserError
from trainer.model import adapters, attention, nf4
from trainer.model.loading import full_state_dict, model_config
from trainer.objectives import linear_ce
from trainer.strategies.base import ModelSource
from trainer.strategies.common import compile_layers, decoder_layers


def build_part(
    cfg: JobConfig,
    device: torch.device,
    mesh: Any,
    n_stages: int,
    conf: Any,
    stage: int,
    weights: dict[str, Any],
    source: ModelSource,
) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """Pipeline stage `stage` of the model (the whole model with pp = 1) on `mesh` (its
    dp, pp and tp dims), filled from `weights` (the checkpoint, memory-mapped): the part,
    and under QLoRA what filling its NF4 weights cost (trainer.model.nf4.load_sharded)."""
    from accelerate import init_empty_weights
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    opts = cfg.strategy
    assert isinstance(opts, FSDPOptions)
    adapter = adapters.enabled(cfg)
    dp, pp, tp = mesh["dp"].size(), opts.pp, opts.tp
    nf4_load = None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            conf,
            attn_implementation=attention.for_job(cfg, source.model_dir).impl,
            dtype=torch.float32,
        )
    weights = checkpoint_layout(model, weights)  # e.g. per-expert Linears → fused experts
    if getattr(model.config, "tie_word_embeddings", False):
        # accelerate's meta init unties lm_head from embed_tokens (Gemma, small Qwen
        # and Llama 3.2): lm_head would stay uninitialised memory after to_empty().
        model.tie_weights()
        # The checkpoint holds the tied weight once; an adapter's copies of lm_head
        # (grown vocabulary: modules_to_save) load it under lm_head's name.
        ties = getattr(model, "_tied_weights_keys", None)
        for dst, src in ties.items() if isinstance(ties, dict) else ():
            if adapter and dst not in weights and src in weights:
                weights = {**weights, dst: weights[src]}
    if cfg.model.gradient_checkpointing or opts.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Under tp lm_head stays replicated (trainer.parallel.tp); under pp the last stage
    # runs it with the labels in the schedule's loss (pipeline.last_stage_loss).
    linear_ce.configure(model, cfg.train.loss, cfg.train.loss_chunk)
    nf4_names: list[str] = []
    if adapter:
        # PEFT on the meta skeleton (the config refuses adapters with tp/pp > 1).
        grew = adapters.grew_vocab(source.model_dir, source.vocab_size)
        skip = set(adapters.embedding_names(model)[1:])  # the output embedding stays
        model = adapters.apply(model, cfg, grew_vocab=grew, kbit=False)
        base = adapters.base_dtype(cfg, device)
        if cfg.model.adapter == "qlora":
            nf4_names = nf4.quantize_skeleton(model, base, skip)
        for p in model.parameters():
            if not p.requires_grad and p.dtype.is_floating_point and not nf4.is_nf4(p):
                p.data = p.data.to(base)  # frozen: the compute dtype, no master copy
    if pp > 1:
        from trainer.parallel.pipeline import cut_to_stage

        cut_to_stage(model, stage, n_stages)
    layers = decoder_layers(model, opts.layer_class)
    if tp > 1:
        from trainer.parallel.tp import apply_tp

        apply_tp(layers, model.config, mesh["tp"])
    if cfg.train.compile:
        compile_layers(layers)  # per block, before sharding (as torchtitan does)
    bf16 = device.type == "cuda" and cfg.train.precision == "bf16"
    kwargs: dict[str, Any] = {
        "mesh": mesh["dp"],
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        ),
        # A stage's weights are used by every microbatch in flight: resharding after
        # each forward would all-gather them once per microbatch.
        "reshard_after_forward": opts.reshard_after_forward and pp == 1,
    }
    if opts.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if nf4_names and dp == 1:
        # One replica: nothing to shard, and FSDP2 (torch 2.13) copies only the first
        # of a tensor subclass's all-gather inputs when its group has one rank; the
        # NF4 weights stay plain parameters of their modules.
        params = dict(model.named_parameters())
        kwargs["ignored_params"] = {params[n] for n in nf4_names}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu" if opts.cpu_offload else device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n].to(b.device))
    own = set(model.state_dict())
    if adapter:
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        # In the model's order: the same on every rank (a set's is not).
        names = [n for n in model.state_dict() if n not in nf4_names]
        mine = adapters.full_weights(names, shapes, weights, cfg.train.seed)
        used = {adapters.base_name(k) for k in [*mine, *nf4_names]}
    else:
        mine = {k: v for k, v in weights.items() if k in own}
        used = set(mine)
    result = set_model_state_dict(
        model, mine, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    if nf4_names:
        nf4_load = nf4.load_sharded(
            model, nf4_names, lambda n: weights[adapters.base_name(n)], device
        )
    tied = set(_tied_keys(model))
    missing = [k for k in result.missing_keys if k not in tied and k not in nf4_names]
    if missing or (pp == 1 and len(used) < len(weights)):
        unexpected = sorted(set(weights) - used)
        raise UserError(
            f"{source.model_dir}: weights do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    model.config.use_cache = False
    return model, nf4_load


def frozen_part(
    cfg: JobConfig, device: torch.device, mesh: Any, source: ModelSource
) -> torch.nn.Module:
    """The starting checkpoint again as a frozen, sharded model (pp = 1): online RL's
    reference with beta > 0 in full fine-tuning. Sharded like the policy, it costs one
    more set of parameter shards per rank and no gradients or optimizer state; its
    forward gathers layer by layer, so every rank scores as many batches."""
    conf = model_config(source.model_dir, cfg, source.vocab_size)
    std = float(getattr(conf, "initializer_range", 0.02))
    weights = full_state_dict(source.model_dir, source.vocab_size, std, cfg.train.seed)
    part, _ = build_part(cfg, device, mesh, 1, conf, 0, weights, source)
    return part.requires_grad_(False).eval()


def _tied_keys(model: Any) -> list[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(keys, dict):
        keys = list(keys)
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    return list(keys)


def checkpoint_layout(model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's weights under the model's own names and shapes, converted as
    transformers' `from_pretrained` converts them: its conversion mapping for the model
    (`get_model_conversion_mapping`: renamings, then at most one converter per key; e.g. a
    mixture-of-experts checkpoint's per-expert `mlp.experts.N.down_proj.weight` Linears
    stacked into transformers 5's fused `mlp.experts.down_proj`). FSDP2 fills its sharded
    skeleton from a plain state dict and so skips from_pretrained; without this the load
    stops with "unexpected ['model.layers.0.mlp.experts.0.down_proj.weight', ...]". A
    checkpoint already in the model's layout passes through unchanged. `model` is the
    causal LM before adapters (meta tensors are fine: only its names and config are read).
    Converted tensors are materialised (stacked) on this rank's host; the rest stay
    memory-mapped."""
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return weights
    renamings = [
        t for t in transforms if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)
    ]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, Any] = {}
    pending: dict[str, Any] = {}
    for key in sorted(weights, key=dot_natural_key):  # experts in their index order
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            out[target] = weights[key]
            continue
        conv = pending.setdefault(target, deepcopy(by_pattern[pattern]))
        conv.add_tensor(target, key, pattern, weights[key])
    for first, conv in pending.items():
        for name, tensor in conv.convert(first, model=model, config=model.config).items():
            out[name] = tensor[0] if isinstance(tensor, list) else tensor
    return out
