"""Model and tokenizer loading, and the device checks that guard GPU-only paths."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainer.config import JobConfig
from trainer.data import load_special_tokens
from trainer.errors import DeviceError, UserError

log = logging.getLogger(__name__)

MODEL_CACHE = Path(
    os.environ.get("RAYLIFT_MODEL_CACHE", Path(tempfile.gettempdir()) / "raylift" / "models")
)


def local_model_dir(cfg: JobConfig) -> Path:
    from trainer.storage import localize

    return localize(cfg.model.path, cfg.storage.endpoint_override, cfg.storage.region, MODEL_CACHE)


def local_tokenizer_dir(cfg: JobConfig) -> Path:
    if cfg.model.tokenizer is None:
        return local_model_dir(cfg)
    from trainer.storage import localize

    return localize(
        cfg.model.tokenizer, cfg.storage.endpoint_override, cfg.storage.region, MODEL_CACHE
    )


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


def check_device(cfg: JobConfig) -> torch.device:
    """Refuse GPU-only settings on a node without a GPU, in one clear line."""
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
        if cfg.model.attn_implementation == "flash_attention_2":
            try:
                import flash_attn  # noqa: F401
            except ImportError:
                raise DeviceError(
                    "model.attn_implementation flash_attention_2: the flash-attn package is "
                    "not installed in this image; use sdpa"
                ) from None
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_model(model_dir: Path, cfg: JobConfig, vocab_size: int) -> Any:
    """Load the HF causal LM in fp32 master weights (autocast handles bf16/fp16 compute)
    and grow the embeddings to the tokenizer's size."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation=cfg.model.attn_implementation
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}: cannot load the model: {str(exc).splitlines()[0]}") from None
    if model.get_input_embeddings().num_embeddings < vocab_size:
        log.info(
            "resizing embeddings %d → %d for added special tokens",
            model.get_input_embeddings().num_embeddings,
            vocab_size,
        )
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
