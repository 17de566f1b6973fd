"""Checkpoints: what is in one, when it counts as complete, and how to find the latest.

A checkpoint folder `step_<N>` holds:
- `model/`: the Hugging Face model + tokenizer (loadable with plain transformers),
- `optimizer.pt`, `scheduler.pt`, `trainer_state.json` (step, epoch, tokens, world size),
- `rng/rank_<r>.pt`: every rank's RNG state,
- `done/rank_<r>.json`: every rank's manifest of the files it wrote, with sizes.

Ranks upload in parallel and in any order, so a folder is complete only when the state
file exists and every rank's manifest is present with all the files it lists at the
listed sizes. A folder torn by a kill mid-upload fails that test and is never loaded;
the previous checkpoint stays the latest.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from trainer.errors import CheckpointError
from trainer.storage import Location

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_manifest(out: Path, rank: int, before: set[str]) -> None:
    """Record the files this rank added to `out` (everything not in `before`)."""
    files = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_file() and rel not in before:
            files[rel] = p.stat().st_size
    done = out / "done"
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank_{rank}.json").write_text(json.dumps(files, sort_keys=True))


def local_files(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def _sizes(loc: Location) -> dict[str, int]:
    sel = pafs.FileSelector(loc.path, recursive=True, allow_not_found=True)
    out = {}
    for info in loc.fs.get_file_info(sel):
        if info.type == pafs.FileType.File:
            out[info.path[len(loc.path.rstrip("/")) + 1 :]] = info.size
    return out


def _read_json(loc: Location, rel: str) -> Any:
    with loc.fs.open_input_stream(loc.join(rel).path) as f:
        return json.loads(f.read().decode())


def completeness(loc: Location) -> tuple[dict[str, Any] | None, str]:
    """(trainer_state, "") if the checkpoint at `loc` is complete, else (None, reason)."""
    sizes = _sizes(loc)
    if STATE_FILE not in sizes:
        return None, f"{STATE_FILE} missing"
    try:
        state = _read_json(loc, STATE_FILE)
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{STATE_FILE} unreadable ({exc})"
    for r in range(int(state["world_size"])):
        rel = f"done/rank_{r}.json"
        if rel not in sizes:
            return None, f"rank {r} manifest missing"
        try:
            manifest = _read_json(loc, rel)
        except (OSError, json.JSONDecodeError):
            return None, f"rank {r} manifest unreadable"
        for name, size in manifest.items():
            if sizes.get(name) != size:
                return None, f"{name}: expected {size} bytes, found {sizes.get(name)}"
    return state, ""


def list_checkpoints(run: Location) -> list[tuple[int, Location]]:
    sel = pafs.FileSelector(run.path, recursive=False, allow_not_found=True)
    found = []
    for info in run.fs.get_file_info(sel):
        m = _STEP_DIR.match(info.base_name)
        if m and info.type == pafs.FileType.Directory:
            found.append((int(m.group(1)), run.join(info.base_name)))
    return sorted(found, key=lambda x: x[0])


def find_latest(run: Location, allow_scratch: bool = False) -> Location | None:
    """The newest complete checkpoint of a run; torn ones are reported and passed over.

    A run folder that holds checkpoints of which none is complete is an error, never a
    silent start from scratch (which would overwrite the run's history with a new model):
    the message names the torn folders. `allow_scratch` (the config's
    checkpoint.allow_restart_from_scratch) turns that into a warning.
    """
    torn = []
    for _step, loc in reversed(list_checkpoints(run)):
        state, why = completeness(loc)
        if state is not None:
            return loc
        log.warning("checkpoint %s is incomplete (%s); using an earlier one", loc.uri, why)
        torn.append(f"{loc.uri} ({why})")
    if torn and not allow_scratch:
        raise CheckpointError(
            f"{run.uri}: no complete checkpoint to resume from, only torn ones: "
            f"{'; '.join(torn)}. Delete them, or set "
            "checkpoint.allow_restart_from_scratch: true to train from step 0"
        )
    if torn:
        log.warning("%s: every checkpoint is torn; training from scratch as allowed", run.uri)
    return None


def step_of(loc: Location) -> int:
    m = _STEP_DIR.match(loc.path.rstrip("/").rsplit("/", 1)[-1])
    if not m:
        raise CheckpointError(f"{loc.uri}: not a step_<N> checkpoint folder")
    return int(m.group(1))


def prune(run: Location, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, and torn ones older than
    the newest complete one. Called only after a new checkpoint is complete, so there is
    never a moment without a usable checkpoint."""
    complete = []
    torn = []
    for step, loc in list_checkpoints(run):
        (complete if completeness(loc)[0] is not None else torn).append((step, loc))
    if not complete:
        return
    newest = complete[-1][0]
    doomed = complete[:-keep_last] + [(s, loc) for s, loc in torn if s < newest]
    for _, loc in doomed:
        log.info("pruning checkpoint %s", loc.uri)
        run.fs.delete_dir(loc.path)


def load_state(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt}: {STATE_FILE} missing; the checkpoint is incomplete"
        ) from None


def load_rng(ckpt: Path, rank: int) -> bool:
    path = ckpt / "rng" / f"rank_{rank}.pt"
    if not path.exists():
        return False
    set_rng_state(torch.load(path, map_location="cpu", weights_only=False))
    return True
