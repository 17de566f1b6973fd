"""The loop's steady steps read nothing back from a tensor (issue 47): every `.item()`,
`.tolist()`, `float(t)`, `int(t)`, `bool(t)`, `.cpu()` or `.numpy()` is a host-device
synchronisation on a GPU. On CPU there is no device to wait for, so the calls themselves are
counted, those made from Raylift's own code (trainer/), step by step, during a real run of
the tiny model in this process (one rank). gpu-check counts the real synchronisations on a
GPU with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from trainer.config import load_config
from trainer.distributed.hostsync import HostReduce, read_floats, to_device
from trainer.loop import train
from trainer.observability.workerstats import WorkerStats
from trainer.runtime import launch
from trainer.runtime.worker import TorchrunRuntime

TRAINER = str(Path(__file__).resolve().parents[3] / "trainer")
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


class ReadCounter:
    """Counts reads of tensor values whose caller is a frame under trainer/."""

    def __init__(self) -> None:
        self.sites: list[str] = []
        self.saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(TRAINER):
                self.sites.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(t, *args, **kwargs)

        return counted

    def __enter__(self) -> ReadCounter:
        for name in READS:
            self.saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from C
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def test_steady_steps_read_no_tensor_and_a_reported_step_reads_one(job, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    path = job(
        "syncs",
        train={"max_steps": 8, "log_every": 4, "eval_every": 100},
        checkpoint={"every_steps": 100, "export_every": 100},
        scaling={"num_workers": 1},
    )
    cfg = load_config(path, [])
    prep = launch.prepare_inputs(cfg, progress=False)
    counter = ReadCounter()
    per_step: list[list[str]] = []
    done = WorkerStats.step_done

    def step_done(self: WorkerStats) -> None:  # the boundary between two steps' reads
        done(self)
        per_step.append(list(counter.sites))
        counter.sites.clear()

    monkeypatch.setattr(WorkerStats, "step_done", step_done)
    with counter:
        last = train(cfg, prep, TorchrunRuntime(cfg, "gloo"))
    assert last["step"] == 8 and len(per_step) == 8
    # per_step[k] holds step k+1's work and, before it, step k's record when k is a
    # multiple of log_every: steps 2-4 and 6-8 come after unreported steps.
    steady = {k + 1: per_step[k] for k in (1, 2, 3, 5, 6, 7)}
    assert all(not sites for sites in steady.values()), steady
    # The record after step 4: the loss and the grad norm, read in one copy.
    assert [s for s in per_step[4] if s.startswith("hostsync.py")] == per_step[4], per_step[4]
    assert len(per_step[4]) == 1, per_step[4]


def test_host_helpers_agree_with_plain_reads():
    assert read_floats(torch.tensor(2.5), None, 3, torch.tensor(0.25, dtype=torch.float64)) == [
        2.5,
        None,
        3.0,
        0.25,
    ]
    assert read_floats(1.0, None) == [1.0, None]
    assert HostReduce(torch.device("cpu"), 1)([1, 2.5, True]) == [1.0, 2.5, 1.0]
    value = 123.0 / 7
    t = to_device(value, torch.device("cpu"))
    assert t.dtype == torch.float32 and t.item() == torch.tensor(value).item()
