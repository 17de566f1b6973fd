"""Print the job-config reference (markdown) from the pydantic models, so the README's
reference cannot drift from the code: `python tools/configref.py` (a test compares them)."""

from __future__ import annotations

import sys
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


def reference() -> str:
    out = [BEGIN]
    for section, sfield in JobConfig.model_fields.items():
        model = sfield.annotation
        out += [
            "",
            f"**`{section}`**",
            "",
            "| field | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, f in model.model_fields.items():
            desc = (f.description or "").replace("|", "\\|")
            out.append(f"| `{section}.{name}` | {_type(f.annotation)} | {_default(f)} | {desc} |")
    out += ["", END]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference())
