"""The causal-LM loss without the whole logits: lm_head, cross-entropy and their gradients
a chunk of tokens at a time.

Hugging Face's causal LMs compute `logits = lm_head(hidden)` for every token and upcast
them to fp32 for the loss; autograd then keeps them and makes their gradient, each
tokens × vocab × 4 bytes (at vocab 128,256 and 8 × 512 tokens, 2 GiB apiece, more than
every checkpointed layer input together). Here the forward walks the tokens in chunks:
per chunk the logits, their log-sum-exp, the chunk's loss and, while the chunk's logits
are at hand, its gradients with respect to the hidden states, the lm_head weight and bias
(accumulated over chunks in fp32). Backward only scales the saved gradients by the
incoming one. Peak: one chunk's logits and their gradient, plus the gradients themselves
(which the plain loss makes too).

What it honours, as `transformers.loss.loss_utils.ForCausalLMLoss` does: the one-token
shift, the ignore label (-100), `num_items_in_batch` (a token sum over that divisor, the
loop's global target count; else the mean over the batch's targets), an lm_head bias,
tied embeddings (the weight is whatever Parameter lm_head holds), and Gemma's
`final_logit_softcapping` (cap · tanh(z / cap)).

How it is wired (`install`): the loaded causal LM's lm_head becomes a `LinearCEHead` (an
nn.Linear that, given labels, returns the loss instead of logits) and the model instance's
forward, given labels, hands them to it. The loss is computed *inside the lm_head module's
call*, so every framework that gathers parameters around a module's call sees its usual
pattern: DeepSpeed ZeRO-3's forward hooks gather the lm_head weight (and its backward hook
re-gathers it), FSDP2's root hooks have unsharded it, a PEFT `modules_to_save` copy of the
head is called with the labels, and the backbone gets the attention kwargs (document
masking) untouched. Without labels both return what they always did (logits), so eval
logits, probes and exports are unchanged.

Which kernel computes it (`pick_kernel`, from `train.loss`): on a CUDA device, liger-kernel's
fused linear cross-entropy (Triton; in the GPU image) for `auto` and `liger` when it is
importable and can give what autograd asks of it; the chunked torch version below
everywhere else, and always for `chunked`.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

IGNORE = -100
"""trainer.data.tokenize.IGNORE: the label Hugging Face's loss skips."""

DEFAULT_CHUNK = 1024
"""Tokens per chunk: at vocab 128,256 one chunk's fp32 logits are 0.5 GiB."""

CAUSAL_LMS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
    }
)
"""Causal LMs whose forward (transformers 5.23.0) was read and is exactly: backbone →
last_hidden_state → lm_head → optional final_logit_softcapping → ForCausalLMLoss. No
logit scaling beyond the softcap; `logits_to_keep` only slices the hidden states (and is
left to the plain forward)."""


def shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's next token (the last position's is ignored), flattened; or the
    caller's already shifted targets (HF's `shift_labels`: a sequence-parallel share, whose
    last token's target is the next share's first token)."""
    if shift_labels is not None:
        return shift_labels.reshape(-1)
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)


# ------------------------------------------------------------------ the chunked loss


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's fp32 logits (the matmul in the model's compute dtype, as lm_head runs it,
    then upcast as the plain loss does), softcapped; and tanh's value for the backward."""
    z = F.linear(h, weight, bias).float()
    if softcap is None:
        return z, None
    t = z.div_(softcap).tanh_()
    return t * softcap, t


def _softmax_loss_(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, so a chunk holds one vocab-wide fp32 buffer: z becomes softmax(z). Returns
    the sum over the chunk's kept targets of logsumexp(z) - z[target] (computed as
    torch.logsumexp does: shifted by the row's max), and the kept-row mask."""
    keep = target != IGNORE
    safe = torch.where(keep, target, 0).unsqueeze(1)
    z.sub_(z.amax(dim=-1, keepdim=True))
    picked = z.gather(1, safe).squeeze(1)
    total = z.exp_().sum(dim=-1, keepdim=True)
    loss = ((total.squeeze(1).log() - picked) * keep).sum()
    z.div_(total)
    return loss, keep


def _divisor(targets: torch.Tensor, num_items: Any) -> torch.Tensor:
    """What the token sum is divided by: the caller's count (HF's num_items_in_batch),
    else the batch's own target count (the plain loss's mean)."""
    if num_items is None:
        return (targets != IGNORE).sum().float()
    if torch.is_tensor(num_items):
        return num_items.to(device=targets.device, dtype=torch.float32)
    return torch.tensor(float(num_items), device=targets.device)


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and gradients in one pass over the chunks; backward scales the saved ones."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        divisor: torch.Tensor,
        softcap: float | None,
        chunk: int,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        scale = 1.0 / divisor
        compute = _compute_dtype(hidden, weight)
        w_low = weight.to(compute)  # cast once, as autocast's cache would
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        f32 = torch.float32
        grad_w = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=f32, device=bias.device) if need_b else None  # type: ignore[union-attr]
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            target = targets[start : start + chunk]
            z, t = _chunk_logits(h, weight, bias, softcap)
            loss, keep = _softmax_loss_(z, target)
            total += loss
            # d(loss)/dz = (softmax(z) - onehot(target)) / divisor on kept rows, 0 elsewhere.
            dz = z
            dz.scatter_add_(1, torch.where(keep, target, 0).unsqueeze(1), -keep.float()[:, None])
            dz.mul_(keep[:, None] * scale)
            if t is not None:
                dz.mul_(t.mul_(t).neg_().add_(1.0))  # through cap · tanh(z / cap)
            del z, t
            low = dz.to(compute)  # the dtype autograd would give the logits' gradient
            if grad_h is not None:
                grad_h[start : start + chunk] = (low @ w_low).to(grad_h.dtype)
            if grad_w is not None:  # in fp32, in place: no weight-sized temporary
                grad_w.addmm_(dz.t(), h.float())
            if grad_b is not None:
                grad_b += dz.sum(0)
            del dz, low  # before the next chunk's logits
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        out_h = None if grad_h is None else grad_h * grad.to(grad_h.dtype)
        out_w = None if grad_w is None else (grad_w * grad).to(ctx.weight_dtype)
        out_b = None if grad_b is None else (grad_b * grad).to(ctx.bias_dtype)
        return out_h, out_w, out_b, None, None, None, None


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype lm_head's matmul runs in: autocast's when it is on, else the inputs'."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(h.dtype, weight.dtype)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    softcap: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF's causal-LM loss of `lm_head(hidden)` against `labels` (unshifted, [batch, seq]),
    a chunk of `chunk` tokens at a time, never holding more than one chunk's logits."""
    h = hidden.reshape(-1, hidden.shape[-1])
    targets = shifted_targets(labels, shift_labels).to(h.device)
    divisor = _divisor(targets, num_items_in_batch)
    needs = torch.is_grad_enabled() and (
        h.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs:
        return _ChunkedLinearCE.apply(h, weight, bias, targets, divisor, softcap, chunk)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        z, _ = _chunk_logits(h[start : start + chunk], weight, bias, softcap)
        total += _softmax_loss_(z, targets[start : start + chunk])[0]
    return total / divisor


# ------------------------------------------------------------------ liger-kernel on CUDA

KERNELS = ("auto", "chunked", "liger")
"""A head's kernel setting: `train.loss` less plain."""

LIGER_VERSION = "0.8.5"
"""The liger-kernel the GPU image pins (images/bnb/requirements.in) and whose
`liger_fused_linear_cross_entropy` and fused_linear_cross_entropy_forward were read."""


@functools.cache
def liger_importable() -> bool:
    """Whether liger-kernel's fused linear cross-entropy (and Triton under it) imports."""
    try:
        from liger_kernel.transformers.functional import (  # noqa: F401
            liger_fused_linear_cross_entropy,
        )
    except Exception:  # ImportError, or Triton failing to find a driver
        return False
    return True


def pick_kernel(kernel: str, cuda: bool, importable: bool, weight_grad_only: bool) -> str:
    """What a labelled head runs: "liger" or "chunked" (ours). `chunked` always runs ours.
    `auto` and `liger` run liger's on a CUDA device when it is importable, except where
    autograd wants lm_head's weight gradient without the hidden states' (a frozen
    backbone under a trained head): liger 0.8.5 computes the weight's gradient only
    together with its input's, so ours runs there."""
    if kernel not in KERNELS:
        raise ValueError(f"loss kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "chunked" or not cuda or not importable or weight_grad_only:
        return "chunked"
    return "liger"


def _kernel_for(kernel: str, hidden: torch.Tensor, weight: torch.Tensor) -> str:
    if kernel == "chunked" or not hidden.is_cuda:  # never imports liger off CUDA
        return "chunked"
    weight_only = torch.is_grad_enabled() and weight.requires_grad and not hidden.requires_grad
    return pick_kernel(kernel, True, liger_importable(), weight_only)


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    softcap: float | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same loss through liger-kernel's fused linear cross-entropy (CUDA only): a
    token sum over the same divisor, the weight's gradient accumulated in fp32. Under
    autocast with fp32 weights liger's own mixed-precision path runs (bf16 logits, fp32
    weight gradient); hidden states and weight of different dtypes otherwise are cast to
    the dtype lm_head's matmul runs in, as the plain loss's matmul would be."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.reshape(-1, hidden.shape[-1])
    if h.dtype != weight.dtype:
        compute = _compute_dtype(h, weight)
        h, weight = h.to(compute), weight.to(compute)
        bias = None if bias is None else bias.to(compute)
    targets = shifted_targets(labels, shift_labels).to(h.device)
    out = liger_fused_linear_cross_entropy(
        h,
        weight,
        targets,
        bias,
        ignore_index=IGNORE,
        reduction="sum",
        softcap=softcap,
        accum_dtype=torch.float32,
    )
    loss = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    return loss.float() / _divisor(targets, num_items_in_batch)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    softcap: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    kernel: str = "auto",
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss through the kernel `pick_kernel` chooses for these tensors."""
    if _kernel_for(kernel, hidden, weight) == "liger":
        return liger_linear_cross_entropy(
            hidden, weight, bias, labels, num_items_in_batch, softcap, shift_labels
        )
    return chunked_linear_cross_entropy(
        hidden, weight, bias, labels, num_items_in_batch, softcap, chunk, shift_labels
    )


# ------------------------------------------------------------------ wiring into HF models


class LinearCEHead(torch.nn.Linear):
    """lm_head that, given labels, returns the loss instead of the logits. Same parameters,
    same state-dict keys; without labels it is nn.Linear."""

    chunk: int = DEFAULT_CHUNK
    kernel: str = "auto"

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        softcap: float | None = None,
        shift_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(
            hidden,
            self.weight,
            self.bias,
            labels,
            num_items_in_batch,
            softcap,
            self.chunk,
            self.kernel,
            shift_labels,
        )


def takes_labels(head: Any) -> bool:
    """Whether calling `head(hidden, labels=...)` reaches a LinearCEHead: the head itself,
    or PEFT's modules_to_save wrapper around copies of it."""
    if isinstance(head, LinearCEHead):
        return True
    inner = getattr(head, "original_module", None)
    copies = getattr(head, "modules_to_save", None)
    if not isinstance(inner, LinearCEHead) or copies is None:
        return False
    return all(isinstance(m, LinearCEHead) for m in copies.values())


def supported(model: Any) -> bool:
    """A causal LM whose forward this module was checked against, with a plain lm_head."""
    head = getattr(model, "lm_head", None)
    return (
        any(c.__name__ in CAUSAL_LMS for c in type(model).__mro__)
        and type(head) in (torch.nn.Linear, LinearCEHead)
        and hasattr(model, "model")
    )


def install(model: Any, chunk: int = DEFAULT_CHUNK, kernel: str = "auto") -> bool:
    """Make `model` (a freshly built HF causal LM, on any device, meta included) compute
    its labelled loss chunk-wise (`kernel`: see pick_kernel). False, with nothing
    changed, for a model it does not know (the plain loss stays)."""
    if kernel not in KERNELS:
        raise ValueError(f"loss kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if not supported(model):
        log.info("loss: %s keeps the plain loss (not a verified causal LM)", type(model).__name__)
        return False
    head = model.lm_head
    head.__class__ = LinearCEHead
    head.chunk, head.kernel = int(chunk), kernel
    model.forward = types.MethodType(_forward, model)
    return True


def configure(model: Any, loss: str, chunk: int = DEFAULT_CHUNK) -> bool:
    """`train.loss` on a freshly built causal LM (whole, before any pipeline cut or tp
    split): whether the chunked loss is now its own. Under tp lm_head stays replicated,
    so the model's forward is unchanged; a pipeline's last stage keeps the LinearCEHead
    and trainer.parallel.pipeline.last_stage_loss calls it with the labels."""
    from trainer.errors import UserError

    if loss == "plain":
        return False
    if loss == "liger" and not liger_importable():
        raise UserError(
            "train.loss liger: liger_kernel does not import on this worker (the GPU image "
            f"has liger-kernel=={LIGER_VERSION}; elsewhere pip install it); use auto or chunked"
        )
    if install(model, chunk, loss):
        return True
    if loss in ("chunked", "liger"):
        raise UserError(
            f"train.loss {loss}: {type(model).__name__} is not a causal LM the chunked "
            f"loss was checked against ({', '.join(sorted(CAUSAL_LMS))}); use auto or plain"
        )
    return False


def _forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
) -> Any:
    """The class's forward, except that with labels the logits are never made whole."""
    plain = isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0
    if labels is None or plain or not takes_labels(self.lm_head):
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    loss = self.lm_head(
        outputs.last_hidden_state,
        labels=labels,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        softcap=getattr(self.config, "final_logit_softcapping", None),
        shift_labels=shift_labels,
    )
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


__all__ = [
    "CAUSAL_LMS",
    "DEFAULT_CHUNK",
    "KERNELS",
    "LinearCEHead",
    "chunked_linear_cross_entropy",
    "configure",
    "install",
    "liger_importable",
    "liger_linear_cross_entropy",
    "linear_cross_entropy",
    "pick_kernel",
]
