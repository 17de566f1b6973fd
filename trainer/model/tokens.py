"""The special-tokens file a job names (`model.special_tokens`, the Ray Llama template's
tokens.json): the tokens the tokenizer gains before training. The model room's, because
the tokenizer and the embedding rows it grows are; the data pipeline reads it from here.
No torch: preflight reads it on the laptop.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import DataError, UserError


def load_special_tokens(path: str | Path) -> list[str]:
    """Read a `{"tokens": [...]}` file (the Ray Llama template's tokens.json)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: special-tokens file not found") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise DataError(f'{path}: expected {{"tokens": ["<TOK>", ...]}} with non-empty strings')
    return tokens
