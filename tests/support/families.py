"""Tiny random models of each family the trainer is checked on (docs/models.md), built
from each family's own transformers config class at test sizes, sharing the test
tokenizer: what a user's Qwen, Mistral, Gemma or Phi folder looks like to the trainer,
in a few hundred kilobytes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
WINDOW = 8
"""The sliding window of the families that have one: below the tests' block size, so
document attention must keep it to be exact."""


def family_config(family: str, vocab: int, hidden: int = 64, layers: int = 2) -> Any:
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    head_dim = hidden // 4
    if family == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(
            **common, head_dim=head_dim, sliding_window=WINDOW, tie_word_embeddings=False
        )
    if family == "gemma2":
        # Tied embeddings, final and attention soft-capping, alternating sliding layers.
        return tf.Gemma2Config(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=WINDOW
        )
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2),
            final_logit_softcapping=30.0,
        )
    if family == "phi3":
        return tf.Phi3Config(**common, tie_word_embeddings=False)
    raise ValueError(family)


def build_family(out: Path, family: str, tokenizer_dir: Path, seed: int = 0, **kw: Any) -> Path:
    """`out/`: a model folder of `family` with the tokenizer of `tokenizer_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab, **kw))
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out
