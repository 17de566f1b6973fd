"""GSM8K-shaped demo data for the RL example: rows with a `question` and an `answer` whose
last line is `#### N`, as GSM8K writes it, so the built-in `math_answer` reward reads the
reference the way it reads the real set's. The questions are small additions ("What is 3
plus 4?") that a tiny Llama can learn in a few minutes on a CPU: an SFT file of the
question and answer as one text, and a prompt file for GRPO (`columns: {prompt:
question}`, `math_answer` options `{column: answer}`). Nothing is downloaded, and nothing
generated is committed: it is written where it is needed.

    python -m tools.demo.gsm8k OUT_DIR [--rows 2000] [--max 9] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def gsm8k_row(a: int, b: int) -> dict[str, str]:
    """One question and its GSM8K-style answer: the working, then `#### N`."""
    return {
        "question": f"What is {a} plus {b}?",
        "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}",
    }


def rows(count: int, largest: int = 9, seed: int = 0) -> list[dict[str, str]]:
    """`count` questions with both numbers drawn from 1..`largest`, seeded."""
    rng = random.Random(seed)
    return [gsm8k_row(rng.randint(1, largest), rng.randint(1, largest)) for _ in range(count)]


def sft_text(row: dict[str, str]) -> str:
    """The SFT row's text: the question, then the answer, as the model should continue a
    GRPO prompt (the prompt is the question alone)."""
    return f"{row['question']} {row['answer']}"


def write(out: Path, count: int, largest: int = 9, seed: int = 0) -> dict[str, Path]:
    """OUT/sft.jsonl ({"text"}), OUT/prompts.jsonl ({"question", "answer"}, other draws of
    the same questions) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sft, prompts = out / "sft.jsonl", out / "prompts.jsonl"
    sft.write_text(
        "".join(json.dumps({"text": sft_text(r)}) + "\n" for r in rows(count, largest, seed))
    )
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows(count, largest, seed + 1)))
    return {"sft": sft, "prompts": prompts}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--max", type=int, default=9, help="largest number in a question")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write(args.out, args.rows, args.max, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
