"""The RAM tier's keeper rules (trainer.checkpoint.keeper) and the restore's choice of step
(trainer.checkpoint.memory.pick_step), on the plain store, no Ray (the keeper actor itself
is tested in tests/integration/test_memory_tier.py)."""

from __future__ import annotations

from trainer.checkpoint.keeper import BUDDY, OWN, SnapshotStore
from trainer.checkpoint.memory import holders, pick_step


def _put(store: SnapshotStore, step: int, rank: int, *, kind=OWN, confirmed=-1, world=2):
    files = {f"rng/rank_{rank}.pt": bytes([step % 256]) * (10 + rank), "x": b"abc"}
    sizes = {n: len(b) for n, b in files.items()}
    return store.put(step, rank, world, files, sizes, kind, confirmed)


def test_a_share_counts_only_when_every_byte_arrived():
    store = SnapshotStore()
    files = {"a": b"12345", "b": b"xy"}
    assert not store.put(3, 0, 1, files, {"a": 5, "b": 2, "c": 7})  # c never came
    assert not store.put(3, 0, 1, {"a": b"123", "b": b"xy"}, {"a": 5, "b": 2})  # cut short
    assert store.inventory() == {}
    assert store.put(3, 0, 1, files, {"a": 5, "b": 2})
    assert store.inventory() == {3: {0: OWN}}
    assert store.get(3, 0) == files
    assert store.nbytes() == 7


def test_the_complete_snapshot_stays_until_a_newer_step_is_confirmed():
    store = SnapshotStore()
    for r in (0, 1):
        _put(store, 4, r)
    held = store.get(4, 0)
    _put(store, 5, 0)  # step 5 arriving: 4 must stay, unchanged
    assert store.inventory() == {4: {0: OWN, 1: OWN}, 5: {0: OWN}}
    assert store.get(4, 0) is held and held["rng/rank_0.pt"] == bytes([4]) * 10
    _put(store, 6, 1, confirmed=5)  # the run confirmed step 5: 4 can go
    assert store.inventory() == {5: {0: OWN}, 6: {1: OWN}}
    assert not _put(store, 4, 0)  # older than the confirmed step: refused
    store.confirm(6)
    assert store.inventory() == {6: {1: OWN}}


def test_a_buddy_copy_never_replaces_an_own_one():
    store = SnapshotStore()
    _put(store, 2, 0)
    _put(store, 2, 0, kind=BUDDY)
    _put(store, 2, 1, kind=BUDDY)
    assert store.inventory() == {2: {0: OWN, 1: BUDDY}}


def _inv(node: str, shares: dict[int, dict[int, str]], world: int = 2) -> dict:
    return {"node_id": node, "shares": shares, "world_sizes": {s: world for s in shares}}


def test_pick_step_is_the_newest_step_every_rank_can_restore():
    a = _inv("a", {7: {0: OWN}, 8: {0: OWN}, 6: {1: BUDDY}, 7 + 0: {0: OWN, 1: BUDDY}})
    b = _inv("b", {8: {1: OWN}, 9: {1: OWN}, 7: {0: BUDDY}})
    assert pick_step([a, b], 2, not_before=0) == 8
    # node b lost: rank 1's share of 8 went with it; 7 survives as a buddy copy
    assert pick_step([a], 2, not_before=0) == 7
    where = holders([a])[7]
    assert where == {0: [(0, OWN)], 1: [(0, BUDDY)]}
    # storage already holds step 8: the RAM tier has nothing newer
    assert pick_step([a], 2, not_before=8) == -1
    # a world size change: the snapshot does not fit the new group
    assert pick_step([a, b], 3, not_before=0) == -1
    assert pick_step([], 2, not_before=0) == -1


def test_a_snapshot_of_another_world_size_is_never_picked():
    a = _inv("a", {5: {0: OWN, 1: OWN}}, world=3)
    assert pick_step([a], 2, not_before=0) == -1
