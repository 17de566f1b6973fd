"""Build the demo's (and the tests') assets locally: a tokenizer trained with `tokenizers`,
a tiny random Llama from a `LlamaConfig`, and a GSM8K-shaped JSONL in the Ray Llama
template's format with its special-tokens file. Nothing is downloaded.

    python tools/tiny.py OUT_DIR [--rows N] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<START_Q>", "<END_Q>", "<START_A>", "<END_A>"]
_OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
_THINGS = ["apples", "books", "coins", "pens", "cards", "shells"]


def qa_pair(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 40), rng.randint(2, 12)
    op = rng.choice(list(_OPS))
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    q = f"{name} has {a} {thing}. What is {a} {op} {b}?"
    ans = _OPS[op](a, b)
    return q, f"{a} {op} {b} is {ans}. The answer is {ans}."


def write_dataset(path: Path, rows: int, seed: int = 0, fmt: str = "input") -> Path:
    """JSONL rows: {"input": "<START_Q>q<END_Q><START_A>a<END_A>"} or {"text": "q a"}."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            q, a = qa_pair(rng)
            if fmt == "input":
                row = {"input": f"<START_Q>{q}<END_Q><START_A>{a}<END_A>"}
            else:
                row = {"text": f"{q} {a}"}
            f.write(json.dumps(row) + "\n")
    return path


def write_special_tokens(path: Path) -> Path:
    path.write_text(json.dumps({"tokens": SPECIAL}))
    return path


def train_tokenizer(out: Path, corpus: list[str], vocab_size: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out))
    return out


def build_model(
    out: Path,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_all(
    out: Path,
    rows: int = 4000,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    eval_rows: int | None = None,
) -> dict[str, Path]:
    """Model folder (weights + tokenizer), train/eval JSONL and tokens.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    corpus = [" ".join(qa_pair(rng)) for _ in range(2000)]
    model_dir = out / "model"
    train_tokenizer(model_dir, corpus)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))
    build_model(model_dir, vocab, hidden=hidden, layers=layers, seed=seed)
    paths = {
        "model": model_dir,
        "train": write_dataset(out / "data" / "train.jsonl", rows, seed=seed),
        "eval": write_dataset(
            out / "data" / "eval.jsonl", eval_rows or max(rows // 10, 50), seed=seed + 7
        ),
        "tokens": write_special_tokens(out / "data" / "tokens.json"),
    }
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    for name, path in build_all(args.out, args.rows, args.hidden, args.layers).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
