"""Job configs the tests start from: the tiny model's job, as a dict to change and write."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from trainer.planner.shape import LLAMA2_7B_CONFIG

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
        # Numbers, not the defaults' auto: these tests judge storage-only resume points
        # (the RAM tier's snapshots would be newer); test_memory_tier sets its own.
        "checkpoint": {"every_steps": 4, "keep_last": 2, "memory_every": 0},
        "storage": {"path": str(storage)},
        "run": {"name": name, "max_failures": 2},
    }


def write_job(tiny: dict[str, Path], root: Path, name: str, **sections: dict[str, Any]) -> Path:
    """`root/<name>.yaml`: the base job (runs under `root/runs`), each section updated."""
    data = copy.deepcopy(base_job(tiny, root / "runs", name))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


LLAMA2_7B = LLAMA2_7B_CONFIG  # the planner tests' reference shape


def llama7b_job(tmp_path: Path, **extra: object) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA2_7B))
    (model / "tokenizer.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    job = {
        "model": {"path": str(model)},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "block_size": 512},
        "train": {"precision": "bf16"},
        "scaling": {"num_workers": 1, "use_gpu": True},
        "storage": {"path": str(tmp_path / "runs")},
        "run": {"name": "plan-test"},
        **extra,
    }
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    return path
