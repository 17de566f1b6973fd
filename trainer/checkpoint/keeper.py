"""A keeper: one per node per run, holding the RAM tier's snapshots in its own memory.

A snapshot of step s is every rank's share of a resume checkpoint (the files that rank
writes into a checkpoint folder, `trainer.checkpoint.manager`), held as bytes. A keeper
holds the shares its node's ranks sent (`own` copies) and the shares a rank on another
node sent it as that node's buddy (`buddy` copies).

The rules that make a snapshot safe to restore:
- a share counts only once all of it has arrived and its sizes match what the sender
  listed (`put` checks them; a put cut short by a kill never lands, Ray delivers an
  actor call's arguments whole or not at all);
- a complete share is never changed in place: a newer step is a new entry beside it;
- a share is dropped only when the run has confirmed a newer step (every rank has that
  step on its own keeper and its buddy: `trainer.checkpoint.memory`), so the newest step
  every rank can restore is never one of those dropped.

The store is plain Python (no Ray) so its rules are unit-tested; `Keeper` is the Ray
actor around it (`trainer.checkpoint.memory` starts it, detached and pinned to its node).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

OWN, BUDDY = "own", "buddy"


@dataclass
class Share:
    step: int
    rank: int
    world_size: int
    kind: str
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


class SnapshotStore:
    """The shares one keeper holds, by (step, rank); see the module's rules."""

    def __init__(self) -> None:
        self._shares: dict[tuple[int, int], Share] = {}
        self._confirmed = -1
        self._lock = threading.Lock()

    def put(
        self,
        step: int,
        rank: int,
        world_size: int,
        files: dict[str, Any],
        sizes: dict[str, int],
        kind: str = OWN,
        confirmed: int = -1,
    ) -> bool:
        """Store one rank's share of `step`, complete only if every listed file arrived
        at its listed size. Returns whether it was stored."""
        own = {name: _own_bytes(data) for name, data in files.items()}
        if set(own) != set(sizes) or any(len(own[n]) != sizes[n] for n in sizes):
            return False
        with self._lock:
            if step < self._confirmed:
                return False  # older than what the run already confirmed: never needed
            key = (step, rank)
            held = self._shares.get(key)
            if held is not None and held.kind == OWN and kind == BUDDY:
                return True  # the own copy is as good; keep it
            self._shares[key] = Share(step, rank, world_size, kind, own)
            self._confirm(confirmed)
            return True

    def confirm(self, step: int) -> None:
        with self._lock:
            self._confirm(step)

    def _confirm(self, step: int) -> None:
        """Every rank holds `step` on two keepers: anything older can go."""
        if step <= self._confirmed:
            return
        self._confirmed = step
        for key in [k for k in self._shares if k[0] < step]:
            del self._shares[key]

    def inventory(self) -> dict[int, dict[int, str]]:
        """{step: {rank: kind}} of the complete shares held."""
        with self._lock:
            out: dict[int, dict[int, str]] = {}
            for (step, rank), share in self._shares.items():
                out.setdefault(step, {})[rank] = share.kind
            return out

    def world_sizes(self) -> dict[int, int]:
        with self._lock:
            return {step: share.world_size for (step, _), share in self._shares.items()}

    def get(self, step: int, rank: int) -> dict[str, bytes] | None:
        with self._lock:
            share = self._shares.get((step, rank))
            return None if share is None else share.files

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._shares.values())

    def clear(self) -> None:
        with self._lock:
            self._shares.clear()
            self._confirmed = -1


def _own_bytes(data: Any) -> bytes:
    """A copy in this process's own memory: an argument Ray hands over may be a view of
    the node's shared object store, which a simulated node's loss would not take away."""
    if type(data) is bytes:
        return data
    return bytes(memoryview(data))


class Keeper:
    """The Ray actor (threaded: a restore reads while a snapshot arrives)."""

    def __init__(self, run: str, node_id: str):
        self.run, self.node_id = run, node_id
        self.store = SnapshotStore()

    def put(
        self,
        step: int,
        rank: int,
        world_size: int,
        files: dict[str, Any],
        sizes: dict[str, int],
        kind: str = OWN,
        confirmed: int = -1,
    ) -> bool:
        return self.store.put(step, rank, world_size, files, sizes, kind, confirmed)

    def confirm(self, step: int) -> None:
        self.store.confirm(step)

    def inventory(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "shares": self.store.inventory(),
            "world_sizes": self.store.world_sizes(),
            "nbytes": self.store.nbytes(),
        }

    def get(self, step: int, rank: int) -> dict[str, bytes] | None:
        return self.store.get(step, rank)

    def clear(self) -> None:
        self.store.clear()

    def pid(self) -> int:
        import os

        return os.getpid()
