"""The run's driver reads the cluster's past runs once, before starting workers
(`Prepared.past_faults`: the same evidence for every rank and every attempt, where each
rank reading storage itself would list and read up to `fault_history.MAX_RUNS` runs'
journals per rank per attempt). Read through the storage Location's pyarrow filesystem
(local, EFS or S3), the way `trainer.resilience.journal.read` reads one run's journal;
`trainer.planner.fault_history` turns the journals into evidence (and stays free of
pyarrow for the laptop's `raylift plan`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow.fs as pafs

from trainer.planner.fault_history import JOURNAL_DIR, Reading, collect, short, stamp
from trainer.storage.location import Location, resolve

log = logging.getLogger(__name__)


class ArrowStore:
    """The runs under a storage Location, listed and read with its pyarrow filesystem."""

    def __init__(self, root: Location):
        self.root = root

    def folders(self) -> list[str]:
        infos = self.root.fs.get_file_info(pafs.FileSelector(self.root.path, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def journal_files(self, folder: str) -> list[tuple[str, float]]:
        path = self.root.join(folder, JOURNAL_DIR).path
        infos = self.root.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return [
            (i.path, stamp(i.mtime))
            for i in infos
            if i.type == pafs.FileType.File and i.base_name.endswith(".jsonl")
        ]

    def text(self, file: str) -> str:
        with self.root.fs.open_input_stream(file) as f:
            return f.read().decode()


def read_location(root: Location, exclude: str | None, **kw: Any) -> Reading:
    """The past runs under `root` but `exclude` (the run itself); storage that cannot be
    listed gives a Reading whose note says so."""
    try:
        return collect(ArrowStore(root), exclude, **kw)
    except OSError as exc:
        return Reading(note=f"{root.uri}: past runs not read: {short(exc)}")


def for_driver(cfg: Any) -> dict[str, Any]:
    """What the driver hands every worker: the other runs under storage.path, when an
    interval is `auto` and the job does not state its rate (checkpoint.failure_rate_per_hour:
    a drill's). Never fails the run: unread, the rates start from the prior."""
    ck = cfg.checkpoint
    auto = "auto" in (ck.every_steps, ck.memory_every)
    if cfg.train.as_test or not auto or ck.failure_rate_per_hour is not None:
        return {}
    began = time.monotonic()
    try:
        root = resolve(cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region)
        reading = read_location(root, exclude=cfg.run.name)
    except Exception as exc:
        reading = Reading(note=f"{cfg.storage.path}: past runs not read: {short(exc)}")
    pools = ", ".join(
        f"{k}: {v.runs} run(s), {v.node_hours:.1f} node-h" for k, v in reading.pools.items()
    )
    log.info(
        "cadence: %d past run(s) read under %s in %.1f s (%s)%s",
        reading.read,
        cfg.storage.path,
        time.monotonic() - began,
        pools or "none journaled a pool",
        f"; {reading.note}" if reading.note else "",
    )
    return reading.to_dict()
