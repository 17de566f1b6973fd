"""Task specs: lm-eval task names, or paths of local task YAMLs with their own data.

A path (ending .yaml/.yml) puts its folder on lm-eval's include path and names the task
its `task:` field gives; with only paths, lm-eval's thousands of built-in task files are
not indexed at all (tens of seconds on a loaded CPU). This module imports no lm-eval,
torch or numpy: preflight checks `train.eval_tasks` with it before launch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

YAML_SUFFIXES = (".yaml", ".yml")
_TASK_LINE = re.compile(r"^task:\s*['\"]?([^'\"#\s]+)", re.MULTILINE)


def is_path(spec: str) -> bool:
    return spec.endswith(YAML_SUFFIXES)


def yaml_task_name(path: Path) -> str | None:
    """The `task:` of a task YAML, read as text (lm-eval's YAMLs may hold `!function`
    tags a plain YAML loader refuses); None when it has none."""
    found = _TASK_LINE.search(path.read_text())
    return found.group(1) if found else None


def spec_error(spec: str) -> str | None:
    """What is wrong with one spec as a user would fix it, or None."""
    if not is_path(spec):
        return None if re.fullmatch(r"[\w.\-]+", spec) else f"{spec!r} is not a task name"
    path = Path(spec)
    if not path.is_file():
        return f"task YAML {spec} does not exist; give a path the driver and every worker can read"
    if yaml_task_name(path) is None:
        return f"task YAML {spec} has no 'task:' line naming the task"
    return None


def resolve(specs: Sequence[str]) -> tuple[list[str], list[str]]:
    """(task names, folders lm-eval must also read) for `specs`."""
    names, folders = [], []
    for spec in specs:
        if is_path(spec):
            path = Path(spec).resolve()
            names.append(yaml_task_name(path) or path.stem)
            if str(path.parent) not in folders:
                folders.append(str(path.parent))
        else:
            names.append(spec)
    return names, folders


def unknown_names(specs: Sequence[str]) -> list[str]:
    """Names in `specs` that lm-eval (installed) does not know: its task index read once."""
    names = [s for s in specs if not is_path(s)]
    if not names:
        return []
    from lm_eval.tasks import TaskManager

    known = set(TaskManager().all_tasks)
    return [n for n in names if n not in known]


def check(specs: Sequence[str], strict: bool) -> list[str]:
    """Before launch: a missing task YAML or an unknown task name is one line (a
    ValueError); where they cannot be checked here (a YAML not on this machine, or no
    lm-eval in a laptop's core install) with `strict` off, notes that the cluster will."""
    import importlib.util

    notes = []
    for spec in specs:
        err = spec_error(spec)
        if err is None:
            continue
        if strict or not is_path(spec) or Path(spec).exists():
            raise ValueError(f"train.eval_tasks: {err}")
        notes.append(f"train.eval_tasks: {spec}: not on this machine; checked on the cluster")
    if not specs:
        return notes
    if importlib.util.find_spec("lm_eval") is None:
        if strict:  # the driver: its image is the workers'; they would fail at step 0
            raise ValueError(
                "train.eval_tasks: lm-eval is not installed here; pip install 'raylift[train]'"
            )
        return [*notes, "train.eval_tasks: lm-eval not installed here; checked on the cluster"]
    if not any(not is_path(s) for s in specs):
        return notes
    unknown = unknown_names(specs)
    if unknown:
        raise ValueError(
            f"train.eval_tasks: unknown lm-eval task {', '.join(unknown)}; `lm-eval ls tasks` "
            "lists the names, or give a local task YAML's path"
        )
    return notes
