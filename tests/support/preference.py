"""A synthetic preference set a tiny model can learn: the chosen answer always states the
result as "The answer is N.", the rejected one hedges ("I think it may be N.")."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools.tiny import qa_pair


def write_pairs(
    path: Path, rows: int, seed: int = 0, chat: bool = False, shape: str = "explicit"
) -> Path:
    """`shape` hh: Anthropic HH-RLHF's text rows, the prompt implicit in both answers."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            q, a = qa_pair(rng)
            n = a.rsplit(" ", 1)[-1].rstrip(".")
            chosen, rejected = f"The answer is {n}.", f"I think it may be {n}."
            if shape == "hh":
                head = f"\n\nHuman: {q}\n\nAssistant:"
                row = {"chosen": f"{head} {chosen}", "rejected": f"{head} {rejected}"}
            elif chat:
                row = {
                    "prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            else:
                row = {"prompt": q, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(row) + "\n")
    return path
