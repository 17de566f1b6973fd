"""`--size 7b|13b|70b`: the Ray Llama-2 DeepSpeed template's layouts, as config defaults.

The template runs one A10G per worker, ZeRO-3 with optimizer and parameters offloaded to
CPU, bf16: 7B and 13B with batch 16 per device on 16 workers, 70B with batch 8 on 32.
A preset only fills what the job's YAML leaves out; the YAML and `--set` always win.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

_COMMON: dict[str, Any] = {
    "scaling.use_gpu": True,
    "train.precision": "bf16",
}
SIZES: dict[str, dict[str, Any]] = {
    "7b": {"train.micro_batch_size": 16, "scaling.num_workers": 16},
    "13b": {"train.micro_batch_size": 16, "scaling.num_workers": 16},
    "70b": {"train.micro_batch_size": 8, "scaling.num_workers": 32},
}
STRATEGY = {"name": "deepspeed", "config": "zero3_offload"}


def _has(data: dict[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def preset_overrides(size: str, config: str | Path, overrides: list[str]) -> list[str]:
    """`--set` items for the preset's fields that neither the YAML nor `overrides` set;
    they go before the user's own overrides."""
    try:
        data = yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []  # load_config reports the file's problem with its line
    if not isinstance(data, dict):
        return []
    given = {item.split("=", 1)[0].strip() for item in overrides}
    out = []
    for key, value in {**_COMMON, **SIZES[size]}.items():
        if not _has(data, key) and key not in given:
            out.append(f"{key}={yaml.safe_dump(value).strip().removesuffix('...').strip()}")
    strategy = data.get("strategy")
    if isinstance(strategy, str):
        strategy = {"name": strategy}
    if strategy is None and not any(k.startswith("strategy.") for k in given):
        out += [f"strategy.{k}={v}" for k, v in STRATEGY.items()]
    elif (
        isinstance(strategy, dict)
        and strategy.get("name") == "deepspeed"
        and "config" not in strategy
        and "strategy.config" not in given
    ):
        out.append(f"strategy.config={STRATEGY['config']}")
    return out
