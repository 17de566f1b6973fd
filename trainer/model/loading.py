"""Model and tokenizer loading, and the device checks that guard GPU-only paths."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from trainer.config import JobConfig
from trainer.errors import DeviceError, UserError
from trainer.model import attention
from trainer.model.folders import MODEL_CACHE as MODEL_CACHE
from trainer.model.folders import local_model_dir as local_model_dir
from trainer.model.folders import local_tokenizer_dir as local_tokenizer_dir
from trainer.model.tokens import load_special_tokens

log = logging.getLogger(__name__)


def load_tokenizer(tokenizer_dir: Path, special_tokens_file: str | None) -> Any:
    """The tokenizer with the job's special tokens added. Only fast tokenizers: the data
    pipeline tokenizes through the Rust backend."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{tokenizer_dir}: cannot load a tokenizer: {str(exc).splitlines()[0]}"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{tokenizer_dir}: a fast (tokenizer.json) tokenizer is required")
    if special_tokens_file:
        tokens = load_special_tokens(special_tokens_file)
        new = [t for t in tokens if t not in tok.get_vocab()]
        if new:
            tok.add_special_tokens(
                {"additional_special_tokens": new}, replace_extra_special_tokens=False
            )
    return tok


def check_device(cfg: JobConfig, local_rank: int = 0) -> torch.device:
    """The device this process trains on, refusing GPU-only settings without a GPU in one
    clear line. Each process binds its own GPU: under torchrun `LOCAL_RANK` says which
    (Ray Train sets CUDA_VISIBLE_DEVICES per worker, so its workers see index 0)."""
    if cfg.scaling.use_gpu:
        if not torch.cuda.is_available():
            raise DeviceError(
                "scaling.use_gpu is true but this worker sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        if cfg.train.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise DeviceError(
                f"train.precision bf16: {torch.cuda.get_device_name()} has no bf16 support; "
                "use fp16 or fp32"
            )
        index = local_rank if local_rank < torch.cuda.device_count() else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""train.precision's names as torch dtypes."""


def _new_rows(n: int, dim: int, std: float, seed: int, salt: int) -> torch.Tensor:
    """Rows for tokens the model has never seen, the same on every rank and in every
    strategy (so FSDP, which does not broadcast initial weights, builds DDP's model)."""
    g = torch.Generator().manual_seed(seed * 1000 + salt)
    return torch.randn(n, dim, generator=g) * std


_GROWN = ("model.embed_tokens.weight", "lm_head.weight", "embed_out.weight")


def grow_rows(name: str, tensor: torch.Tensor, vocab_size: int, std: float, seed: int) -> Any:
    """Pad an embedding/output matrix from the checkpoint to the tokenizer's size."""
    if name not in _GROWN or tensor.shape[0] >= vocab_size:
        return tensor
    extra = _new_rows(vocab_size - tensor.shape[0], tensor.shape[1], std, seed, _GROWN.index(name))
    return torch.cat([tensor, extra.to(tensor.dtype)], dim=0)


def model_config(model_dir: Path, cfg: JobConfig, vocab_size: int) -> Any:
    from transformers import AutoConfig

    try:
        conf = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}: cannot load the model: {str(exc).splitlines()[0]}") from None
    conf.vocab_size = max(conf.vocab_size, vocab_size)
    conf.use_cache = False
    return conf


def full_state_dict(model_dir: Path, vocab_size: int, std: float, seed: int) -> dict[str, Any]:
    """The checkpoint's weights, memory-mapped (safetensors), grown to the vocabulary. Each
    rank reads only the pages its shards touch."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights (convert .bin checkpoints)")
    out: dict[str, Any] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = grow_rows(k, st.get_tensor(k), vocab_size, std, seed)
    return out


def load_model(
    model_dir: Path,
    cfg: JobConfig,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    quantization: Any = None,
) -> Any:
    """Load the HF causal LM (fp32 master weights unless the caller asks for the compute
    dtype, e.g. for a frozen adapter base) and grow the embeddings to the tokenizer's size
    with rows every strategy agrees on. The loss (train.loss, trainer.objectives.linear_ce)
    is the strategy's to configure: the model room sits below the objectives."""
    from transformers import AutoModelForCausalLM

    impl = attention.for_job(cfg, model_dir).impl
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": impl}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}: cannot load the model: {str(exc).splitlines()[0]}") from None
    old = model.get_input_embeddings().num_embeddings
    if old < vocab_size:
        log.info("resizing embeddings %d → %d for added special tokens", old, vocab_size)
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
        std = float(getattr(model.config, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in _GROWN and p.shape[0] == vocab_size:
                    rows = _new_rows(
                        vocab_size - old, p.shape[1], std, cfg.train.seed, _GROWN.index(name)
                    )
                    p[old:] = rows.to(p.dtype)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model
