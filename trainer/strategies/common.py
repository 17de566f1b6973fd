"""Pieces the torch-native strategies share: the optimizer, the precision context, the
loss scaler (or its no-op stand-in), and clipping that also works on sharded grads."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any

import torch

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.strategies.base import param_groups


def build_optimizer(
    cfg: JobConfig, model: torch.nn.Module, keep_empty: bool = True
) -> torch.optim.Optimizer:
    o = cfg.optim
    groups = param_groups(model, o.weight_decay, keep_empty)
    kwargs: dict[str, Any] = {"lr": o.lr, "betas": o.betas, "eps": o.eps}
    if o.name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError(
                "optim.name adamw8bit: bitsandbytes is not installed (use the bnb image)"
            ) from None
        return bnb.optim.AdamW8bit(groups, **kwargs)
    device = next(p.device for p in model.parameters())
    # foreach is the fast multi-tensor path on CPU and GPU; fused is CUDA-only.
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **kwargs)


def autocast(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Computed once per strategy: autocast on GPUs in bf16/fp16, else a null context."""
    if cfg.train.precision == "fp32" or device.type != "cuda":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float16
    return torch.autocast(device_type="cuda", dtype=dtype)


class NullScaler:
    """What a GradScaler does when there is nothing to scale (fp32, bf16)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def loss_scaler(cfg: JobConfig) -> Any:
    if cfg.train.precision == "fp16":
        return torch.amp.GradScaler("cuda")
    return NullScaler()


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float | None
) -> torch.Tensor | float:
    """Clip to `max_norm` (no-op when None) and return the global norm, still on the
    device: the step report reads it when it writes a record (reading it every step would
    make the host wait for the GPU). With DTensor grads (FSDP2) the norm is a partial
    reduction; `full_tensor` completes it across ranks."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach()


class ModelCalls:
    """How the loop runs the model, for strategies whose `model` is the whole model (DDP,
    ZeRO, FSDP without pipeline stages). A pipelined strategy overrides all three: its
    schedule runs forward and backward together, and only its last stage has logits."""

    model: torch.nn.Module
    cfg: JobConfig

    @functools.cached_property
    def objective(self) -> Any:
        """What a batch is and how its loss is made (trainer.objectives: sft, dpo, ...);
        `train_micro` runs its loss where it ran the model's own, under this strategy's
        precision and backward. The loop reads batches through it too. With strategy.sp
        above 1 each worker gets its share of every sequence (trainer.parallel.sequence)."""
        from trainer.objectives import build_objective
        from trainer.parallel import sequence

        return sequence.wrap(build_objective(self.cfg), self.model, self.cfg.strategy.sp)

    def param_count(self) -> int:
        """A sharded parameter counts whole: an FSDP2/TP DTensor's numel is its global
        size, a ZeRO-3 partition keeps its full size in ds_numel."""
        return sum(getattr(p, "ds_numel", None) or p.numel() for p in self.model.parameters())

    def precision(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def train_micro(
        self, x: torch.Tensor, y: torch.Tensor, num_items: Any, **attention: Any
    ) -> torch.Tensor:
        """Forward and backward of one micro batch; its loss (the objective's: for SFT a
        token sum over `num_items`), detached. Only the loss is kept: holding the output
        would keep its logits (a vocab-sized row per token) alive through the backward
        pass. `attention` is the objective's inputs (for SFT trainer.data.packing's
        block-causal mask and restarted positions, or nothing)."""
        with self.precision():
            loss = self.objective.loss(self.model, x, y, num_items, **attention)
        self.backward(loss)
        return loss.detach()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, **attention: Any) -> float:
        """Mean loss over the batch's targets (call inside `evaluating()`)."""
        with self.precision():
            return float(self.model(input_ids=x, labels=y, **attention).loss)

    def logits(self, x: torch.Tensor, **attention: Any) -> torch.Tensor:
        """The model's logits for `x`, on every rank (call inside `evaluating()`)."""
        with self.precision():
            return self.model(input_ids=x, **attention).logits


class Evaluating:
    """Eval mode + no grad, then back to train mode. The model stays in train mode outside
    evaluation (bitsandbytes' 4-bit layers rewrite their weights in eval mode on some
    CPUs; see trainer.model.adapters)."""

    def __init__(self, model: torch.nn.Module, before: Any = None):
        self.model = model
        self.before = before
        self._grad = torch.no_grad()

    def __enter__(self) -> None:
        self.was_training = self.model.training
        if self.before is not None:
            self.before()
        self.model.eval()
        self._grad.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._grad.__exit__(*exc)
        self.model.train(self.was_training)


# ------------------------------------------------------------------ memory accounting
# What a strategy holds, by kind, counted from the tensors themselves: each storage once
# (views, flat buffers and aliases share one), DTensors by their local shard, 4-bit
# weights by their packed bytes plus quantization constants. Counting what Python's
# garbage collector can see misses storages only C++ holds (ZeRO's flat partitions,
# FSDP's padded shards), so every strategy names its own tensors instead.

STATE_KINDS = ("params", "grads", "optimizer")


class StorageCounter:
    """Sums the bytes of distinct storages; a storage already counted (under any kind)
    adds nothing, so a master copy that *is* the parameter partition counts once."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def add(self, tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if hasattr(t, "to_local"):  # DTensor: this rank's shard only
                t = t.to_local()
            if type(t).__name__ == "NF4Tensor":  # torchao's 4-bit base (trainer.model.nf4)
                names, _ = t.__tensor_flatten__()
                total += self.add(getattr(t, n) for n in names)
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() == 0 or ptr in self._seen:
                continue
            self._seen.add(ptr)
            total += storage.nbytes()
        return total


def param_tensors(params: Iterable[torch.nn.Parameter]) -> Iterable[Any]:
    """A parameter's data, and for a bitsandbytes 4-bit weight its quantization state
    (absmax, codebook, nested double-quantization constants)."""
    for p in params:
        yield p
        quant = getattr(p, "quant_state", None)
        if quant is not None:
            yield from _quant_tensors(quant)


def _quant_tensors(quant: Any) -> Iterable[Any]:
    for value in vars(quant).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif hasattr(value, "absmax"):  # the nested state of double quantization
            yield from _quant_tensors(value)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[Any]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def torch_state_nbytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Params, grads and optimizer state of a torch-native strategy (DDP, FSDP2; with
    LoRA/QLoRA the frozen base is in params, and only adapters have grads and state)."""
    params = list(model.parameters())
    count = StorageCounter()
    return {
        "params": count.add(param_tensors(params)),
        "grads": count.add(p.grad for p in params),
        "optimizer": count.add(optimizer_state_tensors(optimizer)),
    }


def compile_layers(layers: list[torch.nn.Module]) -> None:
    """torch.compile each decoder layer in place (`Module.compile`: parameter names, and so
    checkpoints and exports, stay as they are). One layer's graph is reused by every layer
    of the same shape, so compile time does not grow with depth."""
    for layer in layers:
        layer.compile()


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
