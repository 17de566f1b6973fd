"""DeepSpeed's resume state on another world size, with a LoRA adapter: `adapter.pt`, each
trainable weight and its Adam moments whole (fp32, gathered through DeepSpeed's
tensor-fragment API) and the step counts, written beside DeepSpeed's own folder (which
loads only on the world size that wrote it) and loaded into the new partitions. Adam is
elementwise, so only the gradients' reduction order differs from an uninterrupted run.
Apart from the engine (trainer.strategies.deepspeed.engine), which calls it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from trainer.errors import CheckpointError

PORTABLE = "adapter.pt"
"""With an adapter: what trains, whole, for a resume on another world size (above)."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def portable_state(engine: Any, optimizer: Any) -> dict[str, Any]:
    """Collective: on every rank (ZeRO gathers each tensor across them), each
    trainable weight and its Adam moments, whole, in fp32, and the step counts."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tensors = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        got = {"param": safe_get_full_fp32_param(p)}
        got.update({key: safe_get_full_optimizer_state(p, key) for key in MOMENTS})
        tensors[name] = {k: v.detach().float().cpu().clone() for k, v in got.items()}
    steps = {float(state["step"]) for state in optimizer.state.values() if "step" in state}
    if len(steps) != 1:
        raise CheckpointError(f"the optimizer's step counts disagree: {sorted(steps)}")
    return {
        "tensors": tensors,
        "optimizer_step": int(steps.pop()),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
    }


def load_portable(engine: Any, optimizer: Any, stage: int, path: Path) -> None:
    """`adapter.pt` into this world size's partitions, on every rank: the fp32 master
    and Adam moments through DeepSpeed's tensor-fragment API, the compute-dtype
    weights (ZeRO-3: gathered, written, re-partitioned) and the step counts."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    portable = torch.load(path, map_location="cpu", weights_only=True)
    saved = portable["tensors"]
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if sorted(saved) != sorted(n for n, _ in trainable):
        raise CheckpointError(
            f"{path}: its adapter weights are not this job's (model.lora changed?); "
            "keep the adapter settings to resume, or use a new run.name"
        )
    _moments_in_place(engine, optimizer, portable["optimizer_step"])
    for name, p in trainable:
        entry = saved[name]
        if stage == 3:
            _set_zero3_partition(p, entry["param"])
            for key in MOMENTS:
                _set_zero3_partition(p, entry[key], key)
        else:
            safe_set_full_fp32_param(p, entry["param"].to(p.device))
            for key in MOMENTS:
                safe_set_full_optimizer_state(p, entry[key].to(p.device), key)
    gather = (
        deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=0)
        if stage == 3
        else contextlib.nullcontext()
    )
    with gather, torch.no_grad():
        for name, p in trainable:
            p.data.copy_(saved[name]["param"].reshape(p.shape).to(p.dtype))
    engine.global_steps = portable["global_steps"]
    engine.global_samples = portable["global_samples"]


def _moments_in_place(engine: Any, optimizer: Any, step: int) -> None:
    """Adam's state for each flat fp32 partition the inner optimizer steps, at `step`:
    a fresh engine has none yet (torch's AdamW and DeepSpeed's CPU Adam make it at
    their first step), so zeros are put there for the load to fill, in the form each
    optimizer makes (a step tensor for torch's, an int for CPU Adam), as DeepSpeed's
    own universal-checkpoint load does. ZeRO-1/2 then map each weight's fragments of
    the moments (ZeRO-3 reads them at each access)."""
    zero, opt = engine.optimizer, optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if flats is None:
        flats = zero.single_partition_of_fp32_groups
    cpu_adam = type(opt).__name__ == "DeepSpeedCPUAdam"
    # ZeRO-3 empties the groups' params between steps; the flags are every group's.
    group = opt.param_groups[0] if opt.param_groups else {}
    for flat in flats:
        state = opt.state[flat]
        for key in MOMENTS:
            if key not in state:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        if cpu_adam:
            state["step"] = step
        elif group.get("fused") or group.get("capturable"):
            state["step"] = torch.tensor(float(step), device=flat.device)
        else:
            state["step"] = torch.tensor(float(step))
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _set_zero3_partition(param: Any, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of a ZeRO-3 parameter's fp32 master (`key` None) or Adam moment,
    from the whole tensor. DeepSpeed's `safe_set_full_*` does the same but reads past the
    end on the last rank when the partitions are padded (numel not divisible by the world
    size); here the padding is zeroed."""
    z3 = param._z3_optimizer
    part, group = z3._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    n = part.numel()
    start = n * z3._get_param_partition_rank(param)
    chunk = value.flatten()[start : start + n]
    with torch.no_grad():
        part[: chunk.numel()].copy_(chunk.to(part.device, part.dtype))
        part[chunk.numel() :].zero_()
    if z3._swappable_optimizer_subgroup(group):
        z3._optimizer_states_and_gradient_swap_out(group)
