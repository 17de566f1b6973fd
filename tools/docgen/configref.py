"""Write the job-config reference page (docs/config-reference.md) from the pydantic models,
so the documented fields cannot drift from the code: `python tools/configref.py --write`
writes the page, with no flag it prints it (tests/unit/test_docs.py compares them)."""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from trainer.config import JobConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"

INTRO = (
    "Every field of a job's YAML file, generated from the config models in "
    "`trainer/config/`: unknown keys, wrong types and impossible combinations are errors "
    "that name the field (and `file:line` where known), and any field can be overridden "
    "on the command line with `--set section.field=value`."
)


def _type(annotation: Any) -> str:
    text = (
        getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    )
    text = text or str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "null").replace("None", "null")
    # A section's model is named as the package exports it (trainer.config.SourceSpec), not
    # by the module of the package it happens to live in.
    text = re.sub(r"\btrainer\.config\.\w+\.(?=[A-Z])", "trainer.config.", text)
    return text.replace("|", "\\|")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return ""
    return f"`{value!r}`".replace("None", "null").replace("|", "\\|")


def _text(description: str | None) -> str:
    """A description in a table cell: `|` escaped, and `<` outside code spans escaped, so
    `<storage>/<run>` reads as text, not as an HTML tag the page would swallow."""
    parts = re.split(r"(`[^`]*`)", (description or "").replace("|", "\\|"))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """A section is one model, or a discriminated union of them (one per strategy)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) is typing.Annotated:
        return _variants(args[0])
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def reference() -> str:
    """The generated tables, one per section (one per strategy for `strategy`)."""
    out: list[str] = []
    for section, sfield in JobConfig.model_fields.items():
        variants = _variants(sfield.annotation)
        for model in variants:
            title = f"**`{section}`**"
            if len(variants) > 1:
                title += f" with `name: {_name(model)}`"
                title += f": {_text((model.__doc__ or '').strip())}"
            out += ["", title, "", "| field | type | default | meaning |", "|---|---|---|---|"]
            out += _rows(section, model)
    return "\n".join(out).lstrip("\n")


def page() -> str:
    """The whole docs page: a title, one intro sentence, then the reference."""
    return f"# Job config reference\n\n{INTRO}\n\n{reference()}\n"


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
            desc = _text(f.description) + " Off unless given."
            rows.append(f"| `{prefix}.{name}` | section | {_default(f)} | {desc} |")
            rows += _rows(f"{prefix}.{name}", optional[0])
            continue
        desc = _text(f.description)
        rows.append(f"| `{prefix}.{name}` | {_type(f.annotation)} | {_default(f)} | {desc} |")
    return rows


def _name(model: type[BaseModel]) -> str:
    return typing.get_args(model.model_fields["name"].annotation)[0]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page())
        print(f"wrote {PAGE.relative_to(PAGE.parents[1])}")
        return 0
    if argv:
        print("usage: python tools/configref.py [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(page())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
