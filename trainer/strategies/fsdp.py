"""FSDP2: `fully_shard` per decoder layer, then the root.

The model is built as a skeleton (parameters on the meta device, real buffers), sharded,
materialised, and only then filled from the safetensors files: every rank memory-maps the
checkpoint and copies in just its shards, so no rank ever holds the whole model. FSDP
does not broadcast initial weights the way DDP does, so the weights every rank builds
must be equal: the grown embedding rows come from a seeded generator (trainer.model).

Resume state (layout `dcp/1`): a `torch.distributed.checkpoint` folder, sharded, with
the model and optimizer; DCP reshards on load, so a run can resume on another world size.
The export gathers a full state dict on rank 0 (CPU, one copy) and saves a plain Hugging
Face folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import FSDPOptions, JobConfig
from trainer.errors import CheckpointError, UserError
from trainer.model import full_state_dict, model_config
from trainer.strategies import ModelSource
from trainer.strategies.common import (
    Evaluating,
    build_optimizer,
    clip_grad_norm,
    torch_state_nbytes,
)


class FSDPStrategy:
    name = "fsdp"
    layout = "dcp/1"

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int):
        assert isinstance(cfg.strategy, FSDPOptions)
        self.cfg = cfg
        self.opts: FSDPOptions = cfg.strategy
        self.device = device
        self.world_size = world_size
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer

    def setup(self, source: ModelSource) -> None:
        from accelerate import init_empty_weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            # One process (torchrun with one rank): FSDP still needs a process group.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        cfg = self.cfg
        conf = model_config(source.model_dir, cfg, source.vocab_size)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                conf, attn_implementation=cfg.model.attn_implementation, dtype=torch.float32
            )
        if cfg.model.gradient_checkpointing or self.opts.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        bf16 = self.device.type == "cuda" and cfg.train.precision == "bf16"
        kwargs: dict[str, Any] = {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            ),
            "reshard_after_forward": self.opts.reshard_after_forward,
        }
        if self.opts.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        layers = decoder_layers(model, self.opts.layer_class)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)

        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        model.to_empty(device="cpu" if self.opts.cpu_offload else self.device)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n].to(b.device))
        std = float(getattr(conf, "initializer_range", 0.02))
        weights = full_state_dict(source.model_dir, source.vocab_size, std, cfg.train.seed)
        result = set_model_state_dict(
            model, weights, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        tied = set(_tied_keys(model))
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise UserError(
                f"{source.model_dir}: weights do not match the model (missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]})"
            )
        model.config.use_cache = False
        self.model = model
        self.optimizer = build_optimizer(cfg, model)

    def precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the mixed-precision policy casts per module

    @contextlib.contextmanager
    def accumulating(self, last_micro_step: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last_micro_step)  # type: ignore[operator]
        yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        norm = clip_grad_norm(list(self.model.parameters()), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def evaluating(self) -> contextlib.AbstractContextManager:
        return Evaluating(self.model)

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def save_state(self, out: Path, rank: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(out / "dcp"))

    def load_state(self, ckpt: Path, rank: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not (ckpt / "dcp" / ".metadata").exists():
            raise CheckpointError(f"{ckpt}/dcp: no DCP metadata; not an FSDP resume state")
        state = self._state()
        dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )

    def export(self, out: Path, rank: int, tokenizer: Any) -> bool:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank != 0:
            return False
        self.model.save_pretrained(out / "model", state_dict=full, safe_serialization=True)  # type: ignore[operator]
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "model")
        return True

    def state_nbytes(self) -> dict[str, int]:
        # Parameters, grads and Adam moments are DTensors: their local (padded) shards.
        return torch_state_nbytes(self.model, self.optimizer)


def decoder_layers(model: torch.nn.Module, layer_class: str | None) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the named class, else the model's own
    `_no_split_modules` (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer,
    GPTNeoXLayer, ...)."""
    names = [layer_class] if layer_class else list(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        seen = sorted({type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__})
        raise UserError(
            f"strategy.layer_class: no {names or 'decoder layer'} modules in "
            f"{type(model).__name__}; set strategy.layer_class to one of {seen[:6]}"
        )
    return found


def _tied_keys(model: Any) -> list[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(keys, dict):
        keys = list(keys)
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    return list(keys)
