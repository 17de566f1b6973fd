"""A strategy built on a small saved Llama (the checkpoint tests' `model_dir` fixture)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy

VOCAB = 96
"""The small model's vocabulary."""


def small_strategy(model_dir: Path, adapter: str = "none"):
    cfg = load_config(
        {
            "model": {"path": str(model_dir), "adapter": adapter},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 2},
            "scaling": {"num_workers": 1},
            "run": {"name": "nbytes"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, VOCAB))
    s.model.train()
    return s
