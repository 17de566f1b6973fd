"""Checkpoint staging (trainer.storage.staging): a checkpoint holds the state as it was when the
step saved it, however far training has moved on while the background thread writes it;
the manifest comes only after the files; a failed write fails the upload's wait. One
process, a real DDP strategy on a tiny Llama, no Ray."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.jobs import ROOT
from tests.support.small_model import VOCAB, small_strategy
from trainer.checkpoint import manager as ck
from trainer.storage import staging


def _train_step(s, seed: int) -> None:
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    s.backward(s.model(input_ids=x, labels=x).loss)
    s.step()


def _manager(s, ts: ck.TrainState) -> ck.CheckpointManager:
    identity = ck.Identity("ddp", "ddp/1", "none", 2, 16, "staging")
    parts = {"strategy": ck.StrategyPart(s), "rng": ck.RNGPart(0, ts)}
    return ck.CheckpointManager(identity, parts, ts, 0, 1, every=1, export_every=None)


def test_ddp_checkpoint_holds_the_state_of_its_step_while_training_goes_on(model_dir):
    """The background write is held until three more optimizer steps have changed every
    weight and moment in place; the files must still hold the saved step's values."""
    s = small_strategy(model_dir)
    _train_step(s, 0)
    want_model = {k: v.clone() for k, v in s.hf.state_dict().items()}
    want_moment = {
        i: st["exp_avg"].clone() for i, st in enumerate(s.optimizer.state_dict()["state"].values())
    }
    gate = threading.Event()
    real = s.stage_state

    def gated(out: Path, rank: int):
        write = real(out, rank)

        def held() -> None:
            assert gate.wait(60)
            write()

        return held

    s.stage_state = gated
    ts = ck.TrainState(step=1, tokens_seen=32)
    out = _manager(s, ts).save({})
    assert not (out / "done" / "rank_0.json").exists()  # the manifest waits for the files
    for seed in (1, 2, 3):
        _train_step(s, seed)
    assert not torch.equal(s.hf.state_dict()["lm_head.weight"], want_model["lm_head.weight"])
    gate.set()
    staging.wait_written(out)
    assert (out / "done" / "rank_0.json").exists()
    got = torch.load(out / "strategy" / "model.pt", weights_only=True)
    assert set(got) == set(want_model)
    for k, v in want_model.items():
        assert torch.equal(got[k], v), k
    opt = torch.load(out / "strategy" / "optimizer.pt", weights_only=False)
    for i, st in enumerate(opt["state"].values()):
        assert torch.equal(st["exp_avg"], want_moment[i])
    state, why = ck.completeness(_local(out))
    assert why == "" and state["step"] == 1


def test_a_failed_background_write_fails_the_wait_and_leaves_no_manifest(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()

    def broken() -> None:
        raise OSError("No space left on device")

    staging.submit(folder, broken)
    with pytest.raises(OSError, match="No space left"):
        staging.wait_written(folder)
    staging.wait_written(folder)  # nothing pending any more: returns at once


@pytest.fixture
def writes():
    """A writer thread of its own, and the process's "a write hangs" flag reset after."""
    pool = staging.BackgroundWrites()
    yield pool
    staging._stuck.clear()


def _appender(path: Path, chunks: int, every_s: float, gate: threading.Event | None = None):
    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            for _ in range(chunks):
                f.write(b"x" * 1000)
                f.flush()
                time.sleep(every_s)
        if gate is not None:
            gate.wait(60)  # a write that stops making progress here

    return write


def test_a_write_that_stops_making_progress_is_given_up_as_hung(tmp_path, writes):
    """checkpoint.stuck_write_s: a write that put some bytes down and then hangs makes its
    waiter raise after the limit, naming the step; a second wait on an earlier save
    (FSDP's one-DCP-save-at-a-time) then raises too instead of waiting forever."""
    folder, gate = tmp_path / "ckpt", threading.Event()
    writes.submit(folder, _appender(folder / "dcp2" / "__0_0.distcp", 3, 0.05, gate))
    started = time.monotonic()
    try:
        with pytest.raises(staging.CheckpointStuck, match=r"step 7: .* no byte for .*3000 bytes"):
            writes.wait(folder, stuck_s=0.5, what="the checkpoint of step 7")
        took = time.monotonic() - started
        assert 0.5 <= took < 5.0, took
        assert staging.stuck()
        never = Future()
        never.set_running_or_notify_cancel()
        with pytest.raises(staging.CheckpointStuck, match="earlier checkpoint"):
            staging.wait_unless_stuck(never)
    finally:
        gate.set()


def test_the_watch_gives_a_hung_write_up_with_no_waiter_running(tmp_path, writes):
    """The waiter is the upload thread, under SCHED_IDLE: while training keeps every core
    busy it gets no CPU, and a hung write was judged only after the last step. The watch
    thread (training's priority) judges it alone: the flag every later save checks is set,
    and the waiter, once it runs, raises the watch's verdict at once."""
    folder, gate = tmp_path / "ckpt", threading.Event()
    watch = staging.WriteWatch(writes)
    writes.submit(folder, _appender(folder / "model.pt", 2, 0.05, gate))
    started = time.monotonic()
    watch.start(0.4)
    try:
        assert staging._stuck.wait(10), "the watch never judged the hung write"
        assert 0.4 <= time.monotonic() - started < 5.0
        assert "added no byte for" in watch.verdict(folder) and "2000 bytes" in watch.verdict(
            folder
        )
        never = Future()
        never.set_running_or_notify_cancel()
        with pytest.raises(staging.CheckpointStuck, match="earlier checkpoint"):
            staging.wait_unless_stuck(never)
        # A waiter with a limit it would take a minute to reach raises the verdict now.
        waited = time.monotonic()
        with pytest.raises(staging.CheckpointStuck, match=r"step 9: its background write has"):
            writes.wait(folder, stuck_s=60, what="the checkpoint of step 9")
        assert time.monotonic() - waited < 5.0
    finally:
        gate.set()
        watch.stop()


def test_a_slow_write_that_keeps_writing_and_one_queued_behind_it_are_waited_for(tmp_path, writes):
    """Progress resets the clock: a write that adds bytes every 0.2 s for 2 s is not hung
    under a 0.6 s limit, and the write queued behind it is not judged while it waits."""
    first, second = tmp_path / "a", tmp_path / "b"
    writes.submit(first, _appender(first / "model.pt", 10, 0.2))
    writes.submit(second, _appender(second / "model.pt", 1, 0.0))
    errors: list[BaseException] = []
    watch = staging.WriteWatch(writes)  # the watch judges by the same rule
    watch.start(0.6)

    def wait_second() -> None:  # its waiter runs while it is still queued
        try:
            writes.wait(second, stuck_s=0.6, what="the second")
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_second)
    started = time.monotonic()
    waiter.start()
    writes.wait(first, stuck_s=0.6, what="the first")
    assert time.monotonic() - started >= 1.5
    waiter.join(30)
    assert not errors, errors
    assert (first / "model.pt").stat().st_size == 10_000
    assert (second / "model.pt").stat().st_size == 1000
    assert not staging.stuck()
    assert watch.verdict(first) is None and watch.verdict(second) is None
    watch.stop()


@pytest.mark.parametrize(
    ("more_nice", "idle"), [(7, False), (7, True), (0, True)], ids=["nice", "both", "sched_idle"]
)
def test_background_writes_and_the_threads_they_start_yield_the_cpu_to_training(
    tmp_path, more_nice, idle
):
    """checkpoint.background_nice and background_idle: the writer thread, and the transfer
    threads it starts, run at that nice value and (when idle) under SCHED_IDLE; the thread
    that trains keeps its own."""

    def priority() -> tuple[int, int]:
        tid = threading.get_native_id()
        return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

    seen: dict[str, tuple[int, int]] = {}

    def write() -> None:
        seen["writer"] = priority()
        child = threading.Thread(target=lambda: seen.__setitem__("started by it", priority()))
        child.start()
        child.join()

    mine = priority()
    assert mine[1] == os.SCHED_OTHER
    writes = staging.BackgroundWrites()  # a fresh thread, never lowered before
    staging.set_background_priority(mine[0] + more_nice, idle=idle)
    try:
        writes.submit(tmp_path, write)
        writes.wait(tmp_path)
    finally:
        staging.set_background_priority(0)
    staging.lower_priority()  # on the thread that called set_background_priority: refused
    lowered = (mine[0] + more_nice, os.SCHED_IDLE if idle else os.SCHED_OTHER)
    assert seen == {"writer": lowered, "started by it": lowered}
    assert priority() == mine


def test_dcp_async_writes_run_at_the_background_priority(tmp_path, monkeypatch):
    """FSDP's staged checkpoints are written by DCP's own save thread: its file writer
    lowers that thread's priority, and the files load back equal."""
    import torch.distributed.checkpoint as dcp

    from trainer.strategies.fsdp import _background_writer_class

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    real, seen = staging.lower_priority, []

    def recorded() -> None:
        real()
        policy = os.sched_getscheduler(threading.get_native_id())
        seen.append((threading.get_ident() == threading.main_thread().ident, nice(), policy))

    monkeypatch.setattr(staging, "lower_priority", recorded)
    mine = nice()
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    staging.set_background_priority(mine + 5, idle=True)
    try:
        path = str(tmp_path / "dcp2")
        future = dcp.async_save(
            state, checkpoint_id=path, storage_writer=_background_writer_class()(path)
        )
        future.result()
    finally:
        staging.set_background_priority(0)
    assert seen and all(s == (False, mine + 5, os.SCHED_IDLE) for s in seen), seen
    assert nice() == mine
    back = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=path)
    assert torch.equal(back["w"], state["w"]) and int(back["step"]) == 7


class _Scaler:
    def __init__(self) -> None:
        self.cur_scale = 1.0


def test_snapshot_copies_tensors_and_keeps_structure():
    t = torch.arange(4.0)
    scaler = _Scaler()
    shapes = OrderedDict(w=torch.Size([2, 2]))
    state = {"a": t, "b": [t, (t, 3)], "c": "x", "scaler": scaler, "shapes": shapes}
    copy = staging.snapshot(state)
    t.add_(1)
    scaler.cur_scale = 0.5  # the next step's loss scale must not reach the staged copy
    assert torch.equal(copy["a"], torch.arange(4.0))
    assert torch.equal(copy["b"][1][0], torch.arange(4.0)) and copy["b"][1][1] == 3
    assert copy["c"] == "x" and isinstance(copy["b"][1], tuple)
    assert copy["scaler"].cur_scale == 1.0
    assert type(copy["shapes"]) is OrderedDict and type(copy["shapes"]["w"]) is torch.Size


def test_a_stager_copies_into_the_memory_it_kept_once_the_write_before_has_read_it():
    t = torch.arange(8.0)
    state = {"w": t, "head": t[:4], "tail": t[4:]}  # views of one storage: a copy each
    stager = staging.Stager()
    first = stager.claim()
    assert first is not None
    one = staging.snapshot(state, buffers=first)
    # A checkpoint while the first one's write still reads its copies: new memory.
    assert stager.claim() is None
    t.add_(1)
    two = staging.snapshot(state, buffers=None)
    assert one["w"].data_ptr() != two["w"].data_ptr()
    assert torch.equal(one["w"], torch.arange(8.0)) and torch.equal(two["w"], t)
    stager.release(None)  # the second's release frees nothing
    assert stager.claim() is None
    stager.release(first)  # the first write is done
    t.add_(1)
    third = stager.claim()
    three = staging.snapshot(state, buffers=third)
    assert [three[k].data_ptr() for k in state] == [one[k].data_ptr() for k in state]
    assert torch.equal(three["w"], torch.arange(8.0) + 2)
    assert torch.equal(three["head"], torch.arange(4.0) + 2)
    assert torch.equal(three["tail"], torch.arange(4.0, 8.0) + 2)
    # A tensor the stager never saw (an optimizer state made after a load) gets new memory.
    other = staging.snapshot({"w": torch.arange(8.0)}, buffers=third)
    assert other["w"].data_ptr() not in {one[k].data_ptr() for k in state}


def test_ddp_checkpoint_staged_while_the_one_before_is_written_keeps_both_steps(
    model_dir,
    tmp_path,
):
    """Two checkpoints one step apart, the first's write not yet run when the second is
    staged: each file holds its own step (the second may not copy into the memory the
    first's write still reads). A third, after both, is right too (kept memory reused)."""
    s = small_strategy(model_dir)
    writes, wants = [], []
    for n in range(3):
        _train_step(s, n)
        wants.append({k: v.clone() for k, v in s.hf.state_dict().items()})
        (tmp_path / f"ckpt{n}").mkdir()
        writes.append(s.stage_state(tmp_path / f"ckpt{n}", 0))
        if n == 1:  # the first two are written only now, newest first
            writes[1]()
            writes[0]()
    writes[2]()
    for n, want in enumerate(wants):
        got = torch.load(tmp_path / f"ckpt{n}" / "model.pt", weights_only=True)
        assert all(torch.equal(got[k], v) for k, v in want.items()), n
    assert not torch.equal(wants[0]["lm_head.weight"], wants[1]["lm_head.weight"])


def _local(path: Path):
    from trainer.storage.location import resolve

    return resolve(str(path))


# ------------------------------------------------------------------ DeepSpeed (2 ranks)


def _ds_worker(rank: int, stage: int, model: str, init: str, out: str) -> None:
    import gc

    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.strategies.base import ModelSource, build_strategy

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed asks for it, as torchrun and Ray set it
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    config = ROOT / f"trainer/strategies/deepspeed/templates/zero{stage}.json"
    cfg = load_config(
        {
            "model": {"path": model},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 8},
            "strategy": {"name": "deepspeed", "config": str(config)},
            "scaling": {"num_workers": 2},
            "run": {"name": "ds-staging"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), rank, 2)
    s.setup(ModelSource(Path(model), VOCAB))
    s.model.train()

    def step(s, seed: int) -> None:
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed + rank))
        with s.accumulating(True):
            s.backward(s.model(input_ids=x, labels=x).loss)
        s.step()

    step(s, 0)
    inline, staged = Path(out) / "inline", Path(out) / "staged"
    # Both saves see the same state: the inline one is DeepSpeed's own save_checkpoint.
    s.save_state(inline, rank)
    write = s.stage_state(staged, rank)
    for seed in (1, 2, 3):  # three optimizer steps change every partition in place
        step(s, seed)
    write()  # only now are the staged files written
    dist.barrier()
    del s
    gc.collect()
    dist.destroy_process_group()


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):  # e.g. DeepSpeed's loss scaler
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_staged_files_are_its_own_files_of_the_saved_step(model_dir, tmp_path, stage):
    """DeepSpeed's save_checkpoint, run against the staging checkpoint engine, writes the
    files it writes inline (same names, same contents once loaded) even though three
    optimizer steps ran before the background writer did."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _ds_worker,
        args=(stage, str(model_dir), str(tmp_path / "pg"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    inline = tmp_path / "inline"
    names = sorted(str(p.relative_to(inline)) for p in inline.rglob("*") if p.is_file())
    staged = sorted(
        str(p.relative_to(tmp_path / "staged"))
        for p in (tmp_path / "staged").rglob("*")
        if p.is_file()
    )
    assert staged == names
    states = [n for n in names if n.endswith(".pt")]
    assert any("optim_states" in n for n in states) and any("model_states" in n for n in states)
    for name in states:
        want = torch.load(inline / name, map_location="cpu", weights_only=False)
        got = torch.load(tmp_path / "staged" / name, map_location="cpu", weights_only=False)
        _same(want, got, name)


# ------------------------------------------------------------------ FSDP2 (2 ranks)


def _fsdp_worker(rank: int, model: str, init: str, out: str, second: Any) -> None:
    import time

    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.strategies import fsdp
    from trainer.strategies.base import ModelSource, build_strategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    cfg = load_config(
        {
            "model": {"path": model},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 8},
            "strategy": {"name": "fsdp"},
            "scaling": {"num_workers": 2},
            "run": {"name": "fsdp-staging"},
        }
    )
    s = build_strategy(cfg, torch.device("cpu"), rank, 2)
    s.setup(ModelSource(Path(model), VOCAB))
    s.model.train()
    # Rank 0 writes its first checkpoint's files slowly (a busy disk): it holds them until
    # rank 1 is at its second checkpoint (the event), however long rank 1 takes to get
    # there, and then a second for that save's thread to start. Without one save at a time,
    # rank 1's second save is then planning while rank 0's first still has its final
    # collective to run, and the two saves' collectives cross between threads.
    slow = {"first": rank == 0}
    base = fsdp._background_writer_class()

    class Slow(base):
        def write_data(self, plan, planner):
            if slow.pop("first", False):
                assert second.wait(timeout=120), "rank 1 never reached its second checkpoint"
                time.sleep(1)  # the slow disk itself: no event marks a thread's collective
            return super().write_data(plan, planner)

    fsdp._background_writer_class = lambda: Slow
    writes = []
    for n in range(3):  # three checkpoints, one step apart, none waited for in between
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(n + rank))
        with s.accumulating(True):
            s.backward(s.model(input_ids=x, labels=x).loss)
        s.step()
        # What this checkpoint must hold (full_tensor is a collective: every rank asks).
        want = {k: p.full_tensor().clone() for k, p in s.model.named_parameters()}
        if rank == 0:
            torch.save(want, Path(out) / f"want{n}.pt")
        if n == 1 and rank == 1:
            second.set()
        writes.append(s.stage_state(Path(out) / f"ckpt{n}", rank))
    for write in writes:
        write()
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_checkpoints_in_quick_succession_are_written_one_after_another(model_dir, tmp_path):
    """Checkpoints that come faster than DCP writes them (a short interval, a slow disk on
    one rank) are all written, each loadable: the saves' collectives never cross."""
    import time

    import torch.multiprocessing as mp

    second = mp.get_context("spawn").Event()  # rank 1 is at its second checkpoint
    ctx = mp.start_processes(
        _fsdp_worker,
        args=(str(model_dir), str(tmp_path / "pg"), str(tmp_path), second),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + 90  # ~10 s here when the writes are serial
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the checkpoint writes deadlocked"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # Each holds its own step, though all three were copied into the same kept memory.
    wants = [torch.load(tmp_path / f"want{n}.pt", weights_only=True) for n in range(3)]
    for n, want in enumerate(wants):
        dcp_to_torch_save(tmp_path / f"ckpt{n}" / "dcp2", tmp_path / f"full{n}.pt")
        got = torch.load(tmp_path / f"full{n}.pt", weights_only=False)["model"]
        assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
        assert all(torch.equal(got[k], v) for k, v in want.items()), n
    assert not torch.equal(wants[0]["lm_head.weight"], wants[2]["lm_head.weight"])
