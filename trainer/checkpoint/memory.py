"""The RAM tier: snapshots of the resume state in peers' host memory, in front of storage.

A hard kill (a SIGKILLed worker, an OOM kill, a node lost without notice) used to cost
everything since the newest checkpoint in storage. With `checkpoint.memory_every: N`
every rank sends its share of a checkpoint (the same parts `CheckpointManager.save`
writes: strategy state, scheduler, RNG, train state) every N steps to its node's keeper
(`trainer.checkpoint.keeper`), which holds it in its own memory, and then to a buddy
keeper on another node. A new attempt restores from the newest step every rank can find
on some keeper, when that is not older than storage's newest complete checkpoint.

How a snapshot travels, off the step's path: the manager stages the state (the memcpy
async checkpoints already make) and writes it in the background; the tier's own thread
waits for that write, reads the files and puts them on the rank's keeper, then on the
buddy, then deletes the folder. One snapshot per rank in flight: the next one waits for
the previous (it has had a whole interval).

How the run knows a step is safe to drop older ones for (no extra collective): the
step's all-reduce that counts target tokens carries one flag per rank, "my newest
snapshot is on both keepers". When every rank says so, that step is confirmed; and
since a rank starts snapshot L only after its L-1 went through, L-1 is confirmed once
every rank has started L. The next put carries the confirmed step, and keepers drop
what is older. A failed put (a keeper lost with its node) sets the second flag, and
every rank stops the tier for the rest of the attempt (the restart restores).

Restore: every rank reads the keepers' inventories, picks the newest step whose shares
of every rank are held somewhere (and not older than storage's newest), the ranks agree
on the smallest pick (an all-reduce), each fetches that step's shares (its own node's
copy first, then the writer's own keeper, then a buddy copy) into a local folder and
loads it as it would a checkpoint; if any rank failed, all fall back to storage.

DDP and adapters write the model and optimizer on rank 0 only, so those are held once
per run plus the buddy copy, never once per rank; FSDP's shards, one per rank. The
price: each keeper holds up to three snapshots of the shares it keeps (the confirmed
one, a newer complete one, one arriving), own and buddy (`trainer.planner.memory`).

Why one module of about 500 lines: it is one idea, a snapshot's round trip through the
keepers. The put and the restore name the same shares with the same keys, the confirmation
rule decides both what keepers drop and which step a restore may pick, and the driver's
start and end of the keepers name them as the workers find them; split, each half would
have to be read with the other open beside it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer import faults
from trainer.checkpoint.keeper import BUDDY, OWN, Keeper
from trainer.storage import staging
from trainer.storage.local import scratch_dir

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0
"""A keeper that does not answer for this long counts as lost."""
_PREFIX = "raylift-mem-"


def namespace(run_uri: str, run_name: str) -> str:
    """The run's keepers live in a namespace of its own, named from the run (its storage
    location): a resubmission of the run finds them, another run never does."""
    digest = hashlib.sha1(run_uri.encode()).hexdigest()[:10]
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_name)[:40]
    return f"{_PREFIX}{name}-{digest}"


def keeper_name(node_id: str) -> str:
    return f"keeper-{node_id}"


def _keeper_actor(ns: str, node_id: str) -> Any:
    """The node's keeper, started if it is not there: detached (it outlives a worker
    group), no CPU, pinned to its node (soft=False: never moved; it dies with the node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(Keeper)
        .options(
            name=keeper_name(node_id),
            namespace=ns,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=4,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(ns, node_id)
    )


def _worker_nodes() -> list[str]:
    """Alive nodes a training worker can land on (CPUs or GPUs): a head without either
    keeps no snapshots."""
    import ray

    return sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive")
        and (n.get("Resources", {}).get("CPU", 0) > 0 or n.get("Resources", {}).get("GPU", 0) > 0)
    )


def start_keepers(ns: str) -> dict[str, Any]:
    """The driver's part at start: a keeper on every worker node, left-overs of an
    earlier driver of the same run reused (they may hold a newer step than storage)."""
    import ray

    keepers = {node: _keeper_actor(ns, node) for node in _worker_nodes()}
    ray.get([k.pid.remote() for k in keepers.values()], timeout=CALL_TIMEOUT_S)
    log.info("RAM tier: %d keepers in namespace %s", len(keepers), ns)
    return keepers


def list_keepers(ns: str) -> dict[str, Any]:
    """{node_id: handle} of the run's keepers still registered (a dead one is gone)."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != ns or not entry["name"].startswith("keeper-"):
            continue
        try:
            out[entry["name"][len("keeper-") :]] = ray.get_actor(entry["name"], namespace=ns)
        except ValueError:
            continue  # died meanwhile
    return out


def end_keepers(ns: str) -> int:
    """The driver's part at the end (success, failure, cancel): every keeper of the run
    killed, so no snapshot holds a node's memory after it."""
    import ray

    gone = 0
    for handle in list_keepers(ns).values():
        ray.kill(handle, no_restart=True)
        gone += 1
    if gone:
        log.info("RAM tier: %d keepers ended", gone)
    return gone


STAGING_ENV = "RAYLIFT_SNAPSHOT_STAGING"
"""`disk`: stage snapshots on the local disk as before (the bench's "before"); anything
else: in memory where there is room."""
SHM = Path("/dev/shm")
SHM_HEADROOM = 3
"""A snapshot is staged in memory only when the tmpfs has this many times the previous
snapshot's size free (the first one: 1 GiB): a full tmpfs must never fail a snapshot."""


def snapshot_dir(last_bytes: int) -> Path:
    """Where a snapshot's staged files go before the keepers get them: a folder in the
    node's memory (tmpfs /dev/shm) where it has room, so a snapshot never touches the
    disk (written, then read back, then deleted: a disk round trip per snapshot), else
    the local scratch disk as storage checkpoints use."""
    if os.environ.get(STAGING_ENV, "") != "disk" and SHM.is_dir():
        try:
            free = shutil.disk_usage(SHM).free
        except OSError:
            free = 0
        if free >= max(SHM_HEADROOM * last_bytes, 1 << 30):
            return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}snap-", dir=SHM))
    return scratch_dir(f"{_PREFIX}snap-")


def _folder_files(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
    }


def holders(inventories: list[dict[str, Any]]) -> dict[int, dict[int, list[tuple[int, str]]]]:
    """{step: {rank: [(keeper index, kind), ...]}} over every keeper's inventory."""
    out: dict[int, dict[int, list[tuple[int, str]]]] = {}
    for i, inv in enumerate(inventories):
        for step, ranks in inv["shares"].items():
            for rank, kind in ranks.items():
                out.setdefault(int(step), {}).setdefault(int(rank), []).append((i, kind))
    return out


def pick_step(inventories: list[dict[str, Any]], world_size: int, not_before: int) -> int:
    """The newest step whose shares of every rank 0..world_size-1 some keeper holds,
    written by a group of that world size, not older than `not_before` (storage's
    newest); -1 if none."""
    held = holders(inventories)
    sizes: dict[int, set[int]] = {}
    for inv in inventories:
        for step, world in inv.get("world_sizes", {}).items():
            sizes.setdefault(int(step), set()).add(int(world))
    for step in sorted(held, reverse=True):
        if step < not_before:
            break
        if sizes.get(step) == {world_size} and set(held[step]) == set(range(world_size)):
            return step
    return -1


class MemoryTier:
    """The loop's component: asks its two flags in the step's all-reduce, snapshots
    every `memory_every` steps after the checkpoint, and restores at an attempt's start.
    Off (every call a no-op) unless on Ray Train with memory_every > 0."""

    def __init__(self, cfg: Any, rt: Any, manager: Any, device: Any):
        from trainer.planner.cadence import memory_tier_on

        self.rt, self.manager, self.device = rt, manager, device
        on = manager.enabled and memory_tier_on(cfg, getattr(rt, "under_ray", False))
        every = cfg.checkpoint.memory_every
        self.auto = on and every == "auto"  # the cadence decides (trainer.planner.cadence)
        self.every = every if on and isinstance(every, int) else 0
        self.active = self.auto or self.every > 0
        self.cadence = manager.cadence
        self.timer: Any = None  # the step's phase timer: the snapshot's stall is "snap"
        self._last_bytes = 0  # the previous snapshot's size: is there room in memory?
        self.ns = namespace(rt.run.uri, cfg.run.name)
        self.stuck_s = cfg.checkpoint.stuck_write_s
        self.confirmed = -1
        self.newest_held = -1  # the newest step any keeper held at the restore
        self.broken = False
        self._started: list[int] = []
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._own: Any = None
        self._buddy: Any = None
        self.node_id = ""
        if self.active:
            import ray

            self.node_id = ray.get_runtime_context().get_node_id()
            if self.cadence is not None:  # a snapshot due while one travels waits for it
                self.cadence.snapshot_in_flight = self._in_flight

    def _in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    # ---------------------------------------------------------------- each step

    def ask(self) -> list[float]:
        """This rank's flags for the step's all-reduce: its newest snapshot is on both
        keepers; its tier broke; then the cadence's proposal (auto intervals), if any."""
        proposal = self.cadence.ask() if self.cadence is not None else []
        if not self.active:
            return [0.0, 0.0, *proposal]
        p = self._pending
        ok = p is None or (p.done() and p.exception() is None)
        failed = p is not None and p.done() and p.exception() is not None
        return [float(ok), float(self.broken or failed), *proposal]

    def agreed(self, flags: list[float]) -> None:
        """The flags summed over every rank (and the cadence's proposals, summed)."""
        flags, proposals = flags[:2], flags[2:]
        if self.cadence is not None:
            self.cadence.agreed(proposals)
        if not self.active or not self._started:
            if self.active and flags[1] > 0:
                self._stop("a rank's RAM tier failed")
            return
        ok, broken = flags
        if broken > 0:
            self._stop("a rank's snapshot did not reach its keepers")
            return
        newest = self._started[-1] if ok >= self.rt.world_size else self._previous()
        self.confirmed = max(self.confirmed, newest)

    def _previous(self) -> int:
        return self._started[-2] if len(self._started) > 1 else -1

    def _stop(self, why: str) -> None:
        if not self.broken:
            log.warning("RAM tier off for this attempt: %s", why)
        self.broken = True

    def due(self, done: int, is_last: bool) -> bool:
        if not self.active or self.broken or is_last:
            return False
        if self.auto:
            return self.cadence is not None and self.cadence.memory_due(done)
        return done % self.every == 0

    def after_step(self, done: int, is_last: bool) -> None:
        """Called once the step's record is written (a restore must never skip it).
        Snapshot step `done` when due: stage it through the manager (the training
        thread's part), send it on the tier's thread. The cadence learns the step's time."""
        if self.cadence is not None:  # with the step's own phases' time, if timed
            self.cadence.tick(done, getattr(self.timer, "last_compute_s", None))
        if not self.due(done, is_last):
            return
        started = time.perf_counter()
        try:
            self._snapshot(done)
        finally:
            if self.timer is not None:
                self.timer.add("snap", time.perf_counter() - started)
        faults.kill_after_snapshot(done, self.rt.rank, self.rt.world_size, self._pending, self.ns)

    def _snapshot(self, done: int) -> None:
        if self._pending is not None:
            waited = time.monotonic()
            try:
                self._pending.result()
            except Exception as exc:  # reported to every rank through the flags
                log.warning("snapshot of step %s failed: %s", self._started[-1], exc)
                self.broken = True
                return
            finally:
                if self.cadence is not None:  # not the step's time (a fixed interval's wait)
                    self.cadence.blocked(time.monotonic() - waited)
        out = self.manager.save({"snapshot": True}, snapshot_dir(self._last_bytes))
        self._started = [*self._started[-1:], done]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="raylift-mem")
        self._pending = self._pool.submit(self._send, done, out, self.confirmed)

    def _keepers(self) -> tuple[Any, Any]:
        """This rank's node keeper (started here if a new node has none yet) and its
        buddy: the next keeper's node in id order, another node."""
        if self._own is None:
            self._own = _keeper_actor(self.ns, self.node_id)
        if self._buddy is None:  # looked up again until another node has a keeper
            others = sorted(n for n in list_keepers(self.ns) if n != self.node_id)
            after = [n for n in others if n > self.node_id] or others
            if after:
                import ray

                self._buddy = ray.get_actor(keeper_name(after[0]), namespace=self.ns)
        return self._own, self._buddy

    def _send(self, step: int, out: Path, confirmed: int) -> None:
        import ray

        staging.lower_priority()
        began = time.monotonic()
        try:
            staging.wait_written(out, self.stuck_s, f"the snapshot of step {step}")
            files = _folder_files(out)
            sizes = {name: len(b) for name, b in files.items()}
            self._last_bytes = sum(sizes.values())
            ref = ray.put(files)
            own, buddy = self._keepers()
            args = (step, self.rt.rank, self.rt.world_size, ref, sizes)
            if not ray.get(own.put.remote(*args, OWN, confirmed), timeout=CALL_TIMEOUT_S):
                raise RuntimeError(f"keeper on {self.node_id} refused step {step}")
            faults.hold(step, "buddy", self.rt.rank, faults.HOLD_BUDDY_ENV)
            copied = buddy is None or ray.get(
                buddy.put.remote(*args, BUDDY, confirmed), timeout=CALL_TIMEOUT_S
            )
            if not copied:
                raise RuntimeError(f"buddy keeper refused step {step}")
            if self.cadence is not None:  # the write floor: one snapshot in flight
                self.cadence.written("memory", time.monotonic() - began)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def settle(self) -> None:
        """Wait until this rank's snapshot in flight has reached its keepers (or failed:
        logged, as at the end). The drill that kills once the saves have landed calls it."""
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception as exc:
                log.warning("last snapshot not kept: %s", exc)

    def finish(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # ---------------------------------------------------------------- restore

    def restore(self) -> tuple[str, int] | None:
        """Collective. Load the newest snapshot every rank can restore that is not older
        than storage's newest complete checkpoint; ("memory-own" | "memory-buddy", step),
        or None when the attempt must restore from storage (every rank agrees)."""
        if not self.active:
            return None
        import ray

        from trainer.checkpoint import manager as ckpt_mod

        newest = ckpt_mod.find_latest(self.rt.run, allow_scratch=True)
        storage_step = ckpt_mod.step_of(newest) if newest is not None else 0

        started = time.monotonic()
        # This node's keeper first (a node that joined after the driver started has none
        # yet), so that the other ranks find it as a buddy once this collective is done.
        self._own = _keeper_actor(self.ns, self.node_id)
        ray.get(self._own.pid.remote(), timeout=CALL_TIMEOUT_S)
        keepers = list(list_keepers(self.ns).items())
        inventories, handles = [], []
        for node, handle in keepers:
            try:
                inv = ray.get(handle.inventory.remote(), timeout=CALL_TIMEOUT_S)
            except Exception as exc:
                log.info("keeper on %s not answering: %s", node, exc)
                continue
            inventories.append(inv)
            handles.append(handle)
        # A step a keeper holds was trained: the lost steps are counted from it too, when
        # the metrics written before the kill end earlier (S3 rewrites them periodically).
        self.newest_held = max((int(s) for inv in inventories for s in inv["shares"]), default=-1)
        step = pick_step(inventories, self.rt.world_size, max(storage_step, 1))
        step = int(self._reduce(step, "min"))
        if step < 0:
            return None
        where = holders(inventories).get(step, {})
        # A share whose writer's own keeper is gone (its node lost) comes from a buddy copy.
        buddy_used = int(any(all(k != OWN for _, k in where.get(r, [])) for r in where))
        folder = scratch_dir(f"raylift-mem-restore-{step}-")
        ok = 1
        try:
            for rank in range(self.rt.world_size):
                choices = sorted(
                    where.get(rank, []),
                    key=lambda c: (
                        inventories[c[0]]["node_id"] != self.node_id,
                        c[1] != OWN,
                    ),
                )
                for i, _kind in choices:
                    try:
                        files = ray.get(handles[i].get.remote(step, rank), timeout=CALL_TIMEOUT_S)
                    except Exception as exc:
                        log.info("share %d of step %d not read: %s", rank, step, exc)
                        continue
                    if files is None:
                        continue
                    for name, data in files.items():
                        path = folder / name
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(data)
                    break
                else:
                    raise RuntimeError(f"no keeper holds rank {rank}'s share of step {step}")
            self.manager.restore(folder)
        except Exception as exc:
            log.warning("RAM tier restore of step %d failed (%s); storage instead", step, exc)
            ok = 0
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if self._reduce(ok, "min") < 1:
            return None
        source = "memory-buddy" if self._reduce(buddy_used, "max") else "memory-own"
        if self.rt.rank == 0:
            log.info(
                "restored step %d from the RAM tier (%s) in %.2f s",
                step,
                source,
                time.monotonic() - started,
            )
        self.confirmed = step
        return source, step

    def _reduce(self, value: float, op: str) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        if self.rt.world_size > 1 and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return float(t.item())


def pid_of_keepers(ns: str) -> dict[str, int]:
    """{node_id: pid} of the run's keepers (tests, the bench)."""
    import ray

    return {n: ray.get(h.pid.remote(), timeout=CALL_TIMEOUT_S) for n, h in list_keepers(ns).items()}


def resolve_auto(cfg: Any) -> Any:
    """The driver's part of `memory_every: auto`: the config the workers get, with the RAM
    tier off (0) where the planner says its keepers do not fit the smallest worker node's
    host RAM (trainer.planner.tiers), else unchanged. Logged either way."""
    if cfg.checkpoint.memory_every != "auto" or cfg.strategy.name == "deepspeed":
        return cfg
    import ray

    from trainer.planner.tiers import memory_tier_fits

    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and (n.get("Resources", {}).get("CPU", 0) > 0 or n.get("Resources", {}).get("GPU", 0) > 0)
    ]
    ram = [
        float(n["Resources"].get("memory", 0)) + float(n["Resources"].get("object_store_memory", 0))
        for n in nodes
    ]
    gpus = max((int(n["Resources"].get("GPU", 0)) for n in nodes), default=0)
    per_node = max(1, gpus) if cfg.scaling.use_gpu else 1
    on, why = memory_tier_fits(cfg, min(ram) if ram and min(ram) > 0 else None, per_node)
    log.info("%s", why)
    if on:
        return cfg
    checkpoint = cfg.checkpoint.model_copy(update={"memory_every": 0})
    return cfg.model_copy(update={"checkpoint": checkpoint})
