"""Print the job-config reference (markdown) from the pydantic models, so the README's
reference cannot drift from the code: `python tools/configref.py` (a test compares them)."""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from trainer.config import JobConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _type(annotation: Any) -> str:
    text = (
        getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    )
    text = text or str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "null").replace("None", "null")
    return text.replace("|", "\\|")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return ""
    return f"`{value!r}`".replace("None", "null").replace("|", "\\|")


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """A section is one model, or a discriminated union of them (one per strategy)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) is typing.Annotated:
        return _variants(args[0])
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def reference() -> str:
    out = [BEGIN]
    for section, sfield in JobConfig.model_fields.items():
        variants = _variants(sfield.annotation)
        for model in variants:
            title = f"**`{section}`**"
            if len(variants) > 1:
                title += f" with `name: {_name(model)}`"
                title += f": {(model.__doc__ or '').strip()}"
            out += ["", title, "", "| field | type | default | meaning |", "|---|---|---|---|"]
            out += _rows(section, model)
    out += ["", END]
    return "\n".join(out)


def _rows(prefix: str, model: type[BaseModel]) -> list[str]:
    rows = []
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            rows += _rows(f"{prefix}.{name}", f.annotation)  # a nested section: its fields
            continue
        optional = [
            m for m in _variants(f.annotation) if type(None) in typing.get_args(f.annotation)
        ]
        if len(optional) == 1:  # an optional section (off unless given): its line, then fields
            desc = (f.description or "").replace("|", "\\|") + " Off unless given."
            rows.append(f"| `{prefix}.{name}` | section | {_default(f)} | {desc} |")
            rows += _rows(f"{prefix}.{name}", optional[0])
            continue
        desc = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}.{name}` | {_type(f.annotation)} | {_default(f)} | {desc} |")
    return rows


def _name(model: type[BaseModel]) -> str:
    return typing.get_args(model.model_fields["name"].annotation)[0]


if __name__ == "__main__":
    print(reference())
