"""DDP: every rank holds the whole model; gradients are all-reduced.

Resume state (layout `ddp/1`, written by rank 0 since replicas are identical):
`model.pt` (the trainable weights: all of them, or only the adapter's) and
`optimizer.pt`, plus `scaler.pt` under fp16. Composes with the LoRA/QLoRA adapter axis.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.config import JobConfig
from trainer.errors import CheckpointError
from trainer.model import adapters
from trainer.model.loading import load_model
from trainer.objectives import linear_ce
from trainer.storage import staging
from trainer.strategies.base import ModelSource
from trainer.strategies.common import (
    Evaluating,
    ModelCalls,
    autocast,
    build_optimizer,
    clip_grad_norm,
    compile_layers,
    decoder_layers,
    loss_scaler,
    torch_state_nbytes,
)


class DDPStrategy(ModelCalls):
    name = "ddp"
    layout = "ddp/1"

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int):
        self.cfg = cfg
        self.device = device
        self.world_size = world_size
        self._stager = staging.Stager()
        self._autocast = autocast(cfg, device)
        self.scaler = loss_scaler(cfg)
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.source: ModelSource

    def setup(self, source: ModelSource) -> None:
        cfg, device = self.cfg, self.device
        self.source = source
        quant = adapters.quantization(cfg, device)
        dtype = adapters.base_dtype(cfg, device) if adapters.enabled(cfg) else torch.float32
        model = load_model(
            source.model_dir, cfg, source.vocab_size, dtype=dtype, quantization=quant
        )
        linear_ce.configure(model, cfg.train.loss, cfg.train.loss_chunk)
        if adapters.enabled(cfg):
            grew = adapters.grew_vocab(source.model_dir, source.vocab_size)
            model = adapters.apply(model, cfg, grew_vocab=grew)
            # Trainable weights (adapters, resized embeddings) in fp32: the optimizer's
            # master copy; the frozen base stays in the compute dtype.
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.float()
        if quant is None:
            model.to(device)
        if cfg.train.compile:
            compile_layers(decoder_layers(model, None))
        self.hf = model
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=ids)
        else:
            self.model = model
        self.optimizer = build_optimizer(cfg, model)

    def precision(self) -> contextlib.AbstractContextManager:
        return self._autocast

    def accumulating(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel) and not last_micro_step:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> torch.Tensor | float:
        self.scaler.unscale_(self.optimizer)
        norm = clip_grad_norm(list(self.hf.parameters()), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def evaluating(self) -> contextlib.AbstractContextManager:
        return Evaluating(self.model)

    def _resume_state(self) -> dict[str, Any]:
        if adapters.enabled(self.cfg):
            weights: dict[str, Any] = adapters.trainable_state(self.hf)
        else:
            weights = self.hf.state_dict()
        return {
            "model.pt": weights,
            "optimizer.pt": self.optimizer.state_dict(),
            "scaler.pt": self.scaler.state_dict(),
        }

    def save_state(self, out: Path, rank: int) -> None:
        if rank == 0:
            _write(self._resume_state(), out)

    def stage_state(self, out: Path, rank: int) -> staging.Writer | None:
        """A host-memory copy of the trainable weights and the optimizer state, written
        by the background thread (trainer.storage.staging); rank 0 only, as `save_state`."""
        if rank != 0:
            return None
        buffers = self._stager.claim()
        try:
            copy = staging.snapshot(self._resume_state(), self.device.type == "cuda", buffers)
        except BaseException:
            self._stager.release(buffers)
            raise

        def write() -> None:
            try:
                _write(copy, out)
            finally:
                self._stager.release(buffers)

        return write

    def load_state(self, ckpt: Path, rank: int) -> None:
        try:
            weights = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
            opt = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
            scaler = torch.load(ckpt / "scaler.pt", map_location="cpu", weights_only=True)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{ckpt}: {Path(exc.filename).name} is missing") from None
        if adapters.enabled(self.cfg):
            adapters.load_trainable(self.hf, weights, ckpt)
        else:
            missing, unexpected = self.hf.load_state_dict(weights, strict=False)
            if missing or unexpected:
                raise CheckpointError(
                    f"{ckpt}/model.pt: weights do not match the model "
                    f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
                )
        self.optimizer.load_state_dict(opt)
        self.scaler.load_state_dict(scaler)

    def export(self, out: Path, rank: int, tokenizer: Any) -> bool:
        if rank != 0:
            return False
        if adapters.enabled(self.cfg):
            adapters.export(self.hf, out, tokenizer, self.cfg, self.source.model_dir)
            return True
        self.hf.save_pretrained(out / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "model")
        return True

    def state_nbytes(self) -> dict[str, int]:
        # DDP's reducer also keeps its gradient buckets (about one more copy of the
        # gradients) in C++; they are communication buffers, not counted here.
        return torch_state_nbytes(self.hf, self.optimizer)


def _write(files: dict[str, Any], out: Path) -> None:
    for name, obj in files.items():
        torch.save(obj, out / name)
