"""DDP: every rank holds the whole model; gradients are all-reduced.

Checkpoint layout (written by rank 0, since replicas are identical): `model/` is a plain
Hugging Face folder (safetensors + config + tokenizer) that `from_pretrained` loads with
no trainer code, and `optimizer.pt` holds the optimizer state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import CheckpointError


class DDPStrategy:
    name = "ddp"

    def __init__(self, world_size: int):
        self.world_size = world_size

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        model.to(device)
        if not self._distributed():
            return model
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def unwrap(self, model: torch.nn.Module) -> Any:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def build_optimizer(
        self, model: torch.nn.Module, groups: list[dict[str, Any]], **kwargs: Any
    ) -> torch.optim.Optimizer:
        # foreach is the fast multi-tensor path on CPU and GPU; fused is CUDA-only.
        fused = next(model.parameters()).device.type == "cuda"
        return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **kwargs)

    def no_sync(
        self, model: torch.nn.Module, last_micro_step: bool
    ) -> contextlib.AbstractContextManager:
        if isinstance(model, DistributedDataParallel) and not last_micro_step:
            return model.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float | None) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            norms = torch.stack([p.grad.detach().norm(2) for p in params])
            return float(norms.norm(2))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        out: Path,
        rank: int,
        tokenizer: Any,
    ) -> None:
        if rank != 0:
            return
        hf = self.unwrap(model)
        hf.save_pretrained(out / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "model")
        torch.save(optimizer.state_dict(), out / "optimizer.pt")

    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path, rank: int
    ) -> None:
        hf = self.unwrap(model)
        files = sorted((ckpt / "model").glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{ckpt}/model: no safetensors weights in the checkpoint")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        missing, unexpected = hf.load_state_dict(state, strict=False)
        # Tied embeddings are saved once; anything else missing is a broken checkpoint.
        tied = set(getattr(hf, "_tied_weights_keys", None) or [])
        if isinstance(getattr(hf, "_tied_weights_keys", None), dict):
            tied = set(hf._tied_weights_keys)
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise CheckpointError(
                f"{ckpt}/model: weights do not match the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        try:
            opt_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{ckpt}: optimizer.pt is missing") from None
        optimizer.load_state_dict(opt_state)
