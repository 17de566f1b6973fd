"""GGUF, the format llama.cpp (and Ollama, LM Studio) serve, written from an export's Hugging
Face folder with llama.cpp's own Python package (`gguf`): its writer, its quantizers
(gguf.quants) and its tensor-name map for the architecture (gguf.TensorNameMap), so a
name or block layout llama.cpp changes comes with the pinned package, not with a copy.

What this module adds is only what the package leaves to a converter: which HF tensors go
in, the rotary layout of the Q and K projections (llama.cpp's Llama graph expects the
rows of each head interleaved, where HF keeps the two rotary halves apart), and the
tokenizer's metadata (gguf.vocab reads the HF tokenizer folder). Each file is then loaded
back by transformers (which dequantizes it and undoes the Q/K layout) and its logits on
the fixed batch compared with the HF folder's (trainer.checkpoint.export_check).

Llama-family models only in this build (config.json model_type `llama`): the family
transformers' GGUF loader and llama.cpp's `llama` graph share.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config.export import GGUF_MODEL_TYPES
from trainer.errors import UserError

log = logging.getLogger("trainer")

GGUF_DIR = "gguf"
ARCHITECTURES = GGUF_MODEL_TYPES

TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "q8_0": 5e-2}
"""Largest allowed |gguf - hf| over the fixed batch's logits, relative to the largest |hf|
logit. f16 rounds each weight to 11 bits (~5e-4 relative); q8_0 stores blocks of 32 weights
as int8 with one fp16 scale (~4e-3 relative per weight), which compounds over layers."""


class GgufError(UserError):
    """The model cannot be written as GGUF in this build (one line: why and what to do)."""


def file_name(model_name: str, gguf_type: str) -> str:
    return f"{model_name}-{gguf_type}.gguf"


def _qtypes() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F

    return {
        "f32": (Q.F32, F.ALL_F32),
        "f16": (Q.F16, F.MOSTLY_F16),
        "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
    }


def _tensors(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors files, as fp32 numpy, one at a time."""
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise GgufError(f"{hf_dir}: no *.safetensors weights to convert to GGUF")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, st.get_tensor(name).float().numpy()


def _rotary_interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's Q/K rows per head are [first rotary half; second half]; llama.cpp's `llama` graph
    rotates adjacent pairs, so each head's rows are interleaved (row i of the first half,
    then row i of the second)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: Any, hf_dir: Path, n_vocab: int) -> None:
    """The HF tokenizer as llama.cpp's: a byte-level BPE (GPT-2 style) becomes `gpt2` with
    its merges; rows of the embedding past the tokenizer's size get unused placeholders."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    try:
        vocab = BpeVocab(hf_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise GgufError(
            f"{hf_dir}: the tokenizer is not a byte-level BPE ({exc}); GGUF export supports "
            "byte-level BPE tokenizers in this build, drop gguf from export.formats"
        ) from None
    tokens: list[bytes] = []
    types: list[int] = []
    for text, _score, kind in vocab.all_tokens():
        tokens.append(text if isinstance(text, bytes) else str(text).encode())
        types.append(int(kind))
    if len(tokens) > n_vocab:
        raise GgufError(
            f"{hf_dir}: the tokenizer has {len(tokens)} tokens but the model only {n_vocab} "
            "embedding rows; the export is inconsistent, do not serve it"
        )
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        types.append(int(gguf.TokenType.UNUSED))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(hf_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


def write_gguf(hf_dir: Path, out_dir: Path, gguf_type: str, model_name: str = "model") -> Path:
    """`hf_dir` (a plain HF folder: model/ or model_merged/) as one GGUF file of
    `gguf_type` (f32, f16 or q8_0) under `out_dir`. 1-D tensors (the norms) stay f32, as
    llama.cpp keeps them; a 2-D tensor whose rows do not split into q8_0 blocks is f16."""
    try:
        import gguf
        from gguf.quants import quantize
    except ImportError:
        raise GgufError(
            "export.formats: gguf needs the gguf package (pinned in the train extra), which "
            "this environment lacks; install gguf==0.19.0 or drop gguf from export.formats"
        ) from None

    qtypes = _qtypes()
    if gguf_type not in qtypes:
        raise GgufError(
            f"export.gguf_types: {gguf_type!r} is not written in this build; use one of "
            f"{', '.join(qtypes)}"
        )
    conf = json.loads((hf_dir / "config.json").read_text())
    arch = conf.get("model_type")
    if arch not in ARCHITECTURES:
        raise GgufError(
            f"export.formats: gguf supports model_type {', '.join(ARCHITECTURES)} in this "
            f"build; {hf_dir / 'config.json'} says {arch!r}: drop gguf from export.formats"
        )
    qtype, ftype = qtypes[gguf_type]
    heads, layers = conf["num_attention_heads"], conf["num_hidden_layers"]
    kv_heads = conf.get("num_key_value_heads") or heads
    hidden = conf["hidden_size"]
    head_dim = conf.get("head_dim") or hidden // heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(model_name, gguf_type)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(model_name)
    writer.add_context_length(conf.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(conf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(conf.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(conf.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(conf["vocab_size"])
    writer.add_file_type(int(ftype))
    _add_tokenizer(writer, hf_dir, conf["vocab_size"])
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for hf_name, data in _tensors(hf_dir):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GgufError(
                f"{hf_dir}: tensor {hf_name} has no GGUF name for a llama model (gguf "
                f"{gguf.__version__ if hasattr(gguf, '__version__') else ''}); drop gguf "
                "from export.formats"
            )
        if hf_name.endswith("q_proj.weight"):
            data = _rotary_interleave(data, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _rotary_interleave(data, kv_heads)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16 or data.shape[-1] % block:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
