"""What `raylift eval` scores: one Hugging Face folder, or every export of a run
(`<run>/export/step_<N>/`: its `model_merged/` when an adapter run merged, else `model/`),
each with the step it was exported at."""

from __future__ import annotations

import re
from pathlib import Path

from trainer.errors import UserError

_STEP = re.compile(r"step_(\d+)")


def step_of(path: Path) -> int | None:
    """The step in the nearest `step_<N>` folder name of `path`, if any."""
    for part in reversed(path.parts):
        if found := _STEP.fullmatch(part):
            return int(found.group(1))
    return None


def find(target: str, steps: list[int] | None = None) -> list[tuple[int | None, Path]]:
    """(step, model folder) to score, in step order; `steps` keeps only those steps."""
    if target.startswith(("s3://", "hf://")):
        raise UserError(
            f"{target}: raylift eval reads local folders in this build; copy the run's "
            "export/ folder here (aws s3 sync) and give its path"
        )
    root = Path(target)
    if (root / "config.json").is_file():
        found = [(step_of(root.resolve()), root)]
    else:
        found = []
        for folder in sorted((root / "export").glob("step_*")):
            kept = [folder / n for n in ("model_merged", "model") if (folder / n).is_dir()]
            if kept:
                found.append((step_of(folder), kept[0]))
    if steps:
        found = [(s, m) for s, m in found if s in set(steps)]
    if not found:
        raise UserError(
            f"{target}: no model to score: give an export folder (with config.json) or a run "
            "folder with export/step_<N>/model" + (f" at steps {steps}" if steps else "")
        )
    return sorted(found, key=lambda sm: -1 if sm[0] is None else sm[0])
