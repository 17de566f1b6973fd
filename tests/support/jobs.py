"""Job configs the tests start from: the tiny model's job, as a dict to change and write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""


def base_job(tiny: dict[str, Path], storage: Path | str, name: str) -> dict[str, Any]:
    return {
        "model": {"path": str(tiny["model"]), "special_tokens": str(tiny["tokens"])},
        "data": {
            "train_file": str(tiny["train"]),
            "eval_file": str(tiny["eval"]),
            "block_size": 32,
        },
        "train": {
            "micro_batch_size": 4,
            "max_steps": 12,
            "log_every": 1,
            "eval_every": 6,
            "eval_blocks": 16,
            "seed": 7,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_steps": 4, "keep_last": 2},
        "storage": {"path": str(storage)},
        "run": {"name": name, "max_failures": 2},
    }
