"""A Hugging Face model folder's config.json, read one way for everyone who needs it: the
planner (its shape), preflight (its context length) and the strategies (its vocabulary).
Pure: the planner and preflight run it on a laptop, without torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import UserError

CONFIG_FILE = "config.json"


def config_uri(model_path: str) -> str:
    """Where a model folder's config.json is (local path or s3:// URI)."""
    return model_path.rstrip("/") + "/" + CONFIG_FILE


def parse(text: str, src: str) -> dict[str, Any]:
    """config.json's text as a dict; broken JSON is one line naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{src}:{exc.lineno}: not valid JSON") from None


def read_local(model_dir: Path) -> dict[str, Any]:
    path = model_dir / CONFIG_FILE
    return parse(path.read_text(), str(path))
