"""YAML in, JobConfig out: overrides (`--set a.b=c`), and every problem found as one line,
`file:line: field: what`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainer.config.base import STRATEGIES
from trainer.config.job import JobConfig
from trainer.errors import ConfigError


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, for error messages."""


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    sub = (*path, str(key.value))
                    lines[sub] = key.start_mark.line + 1
                    walk(value, sub)

    try:
        root = yaml.compose(text, Loader=_LineLoader)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` → (["train", "lr"], 0.0001). Values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r}: expected section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_errors(exc: ValidationError, source: str, lines: dict[tuple[str, ...], int]) -> str:
    out = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        tag = ""
        if len(loc) > 1 and loc[0] == "strategy" and loc[1] in STRATEGIES:
            tag, loc = loc[1], (loc[0], *loc[2:])  # the union's tag is not a config key
        field = ".".join(loc) if loc else "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/config-reference.md)"
            if tag:
                msg = f"unknown key for strategy {tag} (see docs/config-reference.md)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r})"
        where = source
        probe = loc
        while probe and probe not in lines:
            probe = probe[:-1]
        if probe:
            where = f"{source}:{lines[probe]}"
        if msg.startswith(field + ":") or (not loc and ":" in msg.split(" ")[0]):
            out.append(f"{where}: {msg}")
        else:
            out.append(f"{where}: {field}: {msg}")
    return "\n".join(out)


def load_config(
    source: str | Path | dict[str, Any], overrides: list[str] | None = None
) -> JobConfig:
    """Load, override and validate a job config; raises ConfigError with every problem found."""
    overrides = overrides or []
    if isinstance(source, dict):
        data, name, text = json.loads(json.dumps(source)), "<config>", ""
    else:
        path = Path(source)
        name = str(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections")
    data = apply_overrides(data, overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, name, _key_lines(text))) from None
