"""Checkpoints: one manager owns cadence, layout, completeness and the format field.

A resume checkpoint `step_<N>/` holds a set of stateful parts, each in its own place:
- `strategy/`: the strategy's resume state (model + optimizer; sharded for FSDP),
- `scheduler.pt`: the LR scheduler (rank 0),
- `rng/rank_<r>.pt`: every rank's RNG state,
- `trainer_state.json`: the train state and data position (step, tokens, global batch,
  block size, seed) plus the format: `format` version, `strategy`, `layout`, `adapter`.
  A checkpoint written by another strategy or layout is refused in one clear line.
- `done/rank_<r>.json`: every rank's manifest of the files it wrote, with sizes.

Ranks upload in parallel and in any order, so a folder is complete only when the state
file exists and every rank's manifest is present with all the files it lists at the
listed sizes. A folder torn by a kill mid-upload fails that test and is never loaded;
the previous checkpoint stays the latest. Checkpoints that exist but of which none is
complete are an error, never a silent start from scratch.

The user's export (`export/step_<N>/`: a plain Hugging Face folder, or a PEFT adapter
folder) is separate: written at the end of the run and every `checkpoint.export_every`
steps, never needed to resume.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow.fs as pafs
import torch

from trainer import faults
from trainer.errors import CheckpointError
from trainer.storage import staging
from trainer.storage.local import scratch_dir
from trainer.storage.location import Location
from trainer.storage.staging import STATE_FILE

log = logging.getLogger(__name__)

FORMAT = 2
"""Version of the checkpoint layout; 1 was the HF-folder-inside-the-checkpoint layout."""
EXPORT_DIR = "export"
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
    if not sizes:
        return None, "empty"
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
        if why == "empty":
            continue  # a folder marker an object store kept after a prune: nothing there
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


def discard_torn_after(run: Location, step: int) -> list[str]:
    """Delete torn checkpoint folders newer than `step` (the one being resumed from): a
    new attempt writes those steps again, and must not write into leftovers of a dead one
    (a stale manifest plus new files could pass for a complete checkpoint)."""
    gone = []
    for s, loc in list_checkpoints(run):
        if s > step and completeness(loc)[0] is None:
            log.warning("removing torn checkpoint %s left by a failed attempt", loc.uri)
            run.fs.delete_dir(loc.path)
            gone.append(loc.uri)
    return gone


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


# ------------------------------------------------------------------ the manager


class Stateful(Protocol):
    """One part of a resume checkpoint. `save` writes this rank's share under `out`;
    `load` reads it back from a complete checkpoint (all ranks' files are there).

    A part whose state is large may also have `stage(out, rank) -> Writer | None`: copy
    the state now (training then goes on) and return what writes it under `out` later,
    on the background thread (`trainer.storage.staging`)."""

    def save(self, out: Path, rank: int) -> None: ...

    def load(self, ckpt: Path, rank: int) -> None: ...


@dataclass
class TrainState:
    """The loop's counters; the data position is a pure function of `step`."""

    step: int = 0
    tokens_seen: int = 0


class SchedulerPart:
    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def save(self, out: Path, rank: int) -> None:
        if rank == 0:
            torch.save(self.scheduler.state_dict(), out / "scheduler.pt")

    def load(self, ckpt: Path, rank: int) -> None:
        try:
            state = torch.load(ckpt / "scheduler.pt", map_location="cpu", weights_only=False)
        except FileNotFoundError:
            raise CheckpointError(f"{ckpt}: scheduler.pt is missing") from None
        self.scheduler.load_state_dict(state)
        # The next step's learning rate: a scheduler's state does not set it, and only an
        # optimizer state dict that carries its param groups would (DeepSpeed's adapter
        # state on another world size does not).
        for group, lr in zip(
            self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr


class RNGPart:
    """Every rank's RNG streams. After a world-size change some ranks have none: they
    reseed from (seed, step, rank), which keeps runs reproducible if not bit-identical."""

    def __init__(self, seed: int, train_state: TrainState):
        self.seed = seed
        self.train_state = train_state

    def save(self, out: Path, rank: int) -> None:
        (out / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), out / "rng" / f"rank_{rank}.pt")

    def load(self, ckpt: Path, rank: int) -> None:
        if not load_rng(ckpt, rank):
            log.warning(
                "no RNG state for rank %d in %s (world size changed); reseeding", rank, ckpt
            )
            seed = self.seed + 1000 * self.train_state.step + rank
            random.seed(seed)
            np.random.seed(seed % (2**32))
            torch.manual_seed(seed)


class StrategyPart:
    """The strategy's own resume state, under `strategy/` (its layout, its files)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def save(self, out: Path, rank: int) -> None:
        (out / "strategy").mkdir(exist_ok=True)
        self.strategy.save_state(out / "strategy", rank)

    def stage(self, out: Path, rank: int) -> staging.Writer | None:
        """The strategy's staged save where it has one (all of today's), else an inline
        save and nothing left to write."""
        stage = getattr(self.strategy, "stage_state", None)
        if stage is None:
            self.save(out, rank)
            return None
        (out / "strategy").mkdir(exist_ok=True)
        return stage(out / "strategy", rank)

    def load(self, ckpt: Path, rank: int) -> None:
        self.strategy.load_state(ckpt / "strategy", rank)


@dataclass
class Identity:
    """What a checkpoint must agree with to be resumed: written into its state file."""

    strategy: str
    layout: str
    adapter: str
    global_batch: int
    block_size: int
    run_name: str
    reads: tuple[str, ...] = ()
    """Older layouts this strategy still loads (FSDP reads dcp/1); not written."""

    def check(self, state: dict[str, Any], where: Path | str) -> None:
        fmt = state.get("format", 1)
        if fmt != FORMAT:
            raise CheckpointError(
                f"{where}: checkpoint format {fmt} is not this trainer's format {FORMAT} "
                "(written by another Raylift version); use a new run.name"
            )
        for key, what in (("strategy", "strategy.name"), ("layout", "strategy layout")):
            if key == "layout" and state.get(key) in self.reads:
                continue
            if state.get(key) != getattr(self, key):
                raise CheckpointError(
                    f"{where}: checkpoint was written by strategy {state.get('strategy')} "
                    f"(layout {state.get('layout')}), this job uses {self.strategy} (layout "
                    f"{self.layout}); set {what} back to resume, or use a new run.name"
                )
        if state.get("adapter") != self.adapter:
            raise CheckpointError(
                f"{where}: checkpoint trained model.adapter {state.get('adapter')}, this job "
                f"has {self.adapter}; keep it to resume, or use a new run.name"
            )
        if state.get("global_batch") != self.global_batch:
            raise CheckpointError(
                f"{where}: checkpoint was trained with global batch "
                f"{state.get('global_batch')}, this config has {self.global_batch}; keep "
                "micro_batch_size × grad_accum × num_workers equal to resume, or use a new "
                "run.name"
            )
        if state.get("block_size") != self.block_size:
            raise CheckpointError(
                f"{where}: checkpoint used block_size {state.get('block_size')}, config has "
                f"{self.block_size}; use a new run.name to change it"
            )


class CheckpointManager:
    """Cadence, layout and completeness of resume checkpoints, and the export cadence.
    Adding a part to the checkpoint means adding one `Stateful` to `parts`."""

    def __init__(
        self,
        identity: Identity,
        parts: dict[str, Stateful],
        train_state: TrainState,
        rank: int,
        world_size: int,
        every: int | str | None,
        export_every: int | None,
        enabled: bool = True,
        cadence: Any = None,
    ):
        """`every`: steps between checkpoints, None (only at the end) or "auto" (the
        `cadence` decides); `cadence` (trainer.planner.cadence.Cadence) also measures
        every save's stall and write, of either tier."""
        self.cadence = cadence
        self.identity = identity
        self.parts = parts
        self.train_state = train_state
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.export_every = export_every
        self.enabled = enabled

    def due(self, step: int, end: int) -> bool:
        if self.every == "auto":  # the cadence decides (checkpoint.every_steps: auto)
            periodic = self.cadence is not None and self.cadence.storage_due(step)
        else:
            periodic = self.every is not None and step % self.every == 0
        return self.enabled and (step == end or periodic)

    def export_due(self, step: int, end: int, final: bool) -> bool:
        periodic = self.export_every is not None and step % self.export_every == 0
        return self.enabled and ((step == end and final) or periodic)

    def save(self, extra: dict[str, Any], out: Path | None = None) -> Path:
        """Write this rank's share of a checkpoint into a fresh local folder (the runtime
        uploads it; `out`: a folder to use instead, the RAM tier's in memory) and its
        manifest. Collective: every rank calls it. Parts that stage
        are only copied here; their files and the manifest are written in the background
        (`trainer.storage.staging`), and the runtime's upload waits for them."""
        step = self.train_state.step
        started = time.monotonic()
        tier = "memory" if extra.get("snapshot") else "storage"
        out = out or scratch_dir(f"raylift-ckpt-{step}-r{self.rank}-")
        writers: list[staging.Writer] = []
        for part in self.parts.values():
            stage = getattr(part, "stage", None)
            if stage is None:
                part.save(out, self.rank)
            elif (writer := stage(out, self.rank)) is not None:
                writers.append(writer)
        if self.rank == 0:
            state = {
                "format": FORMAT,
                **{k: v for k, v in asdict(self.identity).items() if k != "reads"},
                "step": step,
                "tokens_seen": self.train_state.tokens_seen,
                "world_size": self.world_size,
                "parts": sorted(self.parts),
                **extra,
            }
            (out / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        cadence = self.cadence
        if not writers:
            write_manifest(out, self.rank, before=set())
            if cadence is not None:
                cadence.saved(tier, time.monotonic() - started)
            return out
        staging.copy_done()
        rank = self.rank
        if cadence is not None:  # the training thread's part: the stall
            cadence.saved(tier, time.monotonic() - started)

        def finish() -> None:
            for writer in writers:
                writer()
            faults.hold_write(step, rank)
            write_manifest(out, rank, before=set())

        staging.submit(out, finish)
        return out

    def restore(self, ckpt: Path) -> dict[str, Any]:
        """Check the checkpoint is resumable by this job, then load every part."""
        state = load_state(ckpt)
        self.identity.check(state, ckpt)
        self.train_state.step = int(state["step"])
        self.train_state.tokens_seen = int(state["tokens_seen"])
        for part in self.parts.values():
            part.load(ckpt, self.rank)
        return state


def latest_export(run: Location) -> Location | None:
    """The newest export folder of a run (export/step_<N>/)."""
    found = list_checkpoints(run.join(EXPORT_DIR))
    return found[-1][1] if found else None
