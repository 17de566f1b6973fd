"""Inputs the benchmarks build: a synthetic corpus of a given size, and Llama models of a
given width and depth (random weights, a fixed vocabulary)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools.tiny import qa_pair

VOCAB = 8000
"""The benchmark models' vocabulary."""


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        while f.tell() < megabytes * 1_000_000:
            parts = [" ".join(qa_pair(rng)) for _ in range(rng.randint(8, 40))]
            f.write(json.dumps({"text": " ".join(parts)}) + "\n")
    return path


def make_model(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=int(hidden * 2.6875),
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if not (out / "config.json").exists():
        LlamaForCausalLM(conf).save_pretrained(out, safe_serialization=True)
    return out
