"""The fault drills inside an online RL step (trainer.faults.RLDrills): their
specs, the SIGKILL itself (in a child process: once per run, only the last rank, the
update's only before its last micro batch), and the weights' digest."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from tempfile import gettempdir

import pytest
import torch

from trainer import faults

ROOT = Path(__file__).resolve().parents[3]

KILL = """
import sys
from trainer.faults import RLDrills
d = RLDrills(sys.argv[1], int(sys.argv[2]), 2)
getattr(d, sys.argv[3])(*map(int, sys.argv[4:]))
print("survived")
"""


def _child(env: dict[str, str], run: str, rank: int, hook: str, *args: int) -> int:
    cmd = [sys.executable, "-c", KILL, run, str(rank), hook, *map(str, args)]
    # TMPDIR as here: the drill's once-per-run marker lives in the temp folder (CI sets one)
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "TMPDIR": gettempdir(), **env}
    return subprocess.run(cmd, env=environ, cwd=ROOT, capture_output=True, timeout=120).returncode


def test_specs(monkeypatch) -> None:
    assert faults.in_step_kill(faults.KILL_IN_ROLLOUT_ENV) is None
    monkeypatch.setenv(faults.KILL_IN_ROLLOUT_ENV, " 7 ")
    assert faults.in_step_kill(faults.KILL_IN_ROLLOUT_ENV) == 7
    for bad in ("0", "7@2", "x"):
        monkeypatch.setenv(faults.KILL_IN_UPDATE_ENV, bad)
        with pytest.raises(ValueError, match=f"{faults.KILL_IN_UPDATE_ENV}='{bad}'.*N >= 1"):
            faults.in_step_kill(faults.KILL_IN_UPDATE_ENV)
    monkeypatch.delenv(faults.KILL_IN_UPDATE_ENV)
    assert faults.RLDrills("run", 0, 2).armed
    monkeypatch.delenv(faults.KILL_IN_ROLLOUT_ENV)
    assert not faults.RLDrills("run", 0, 2).armed
    monkeypatch.setenv(faults.WEIGHT_DIGEST_ENV, "1")
    assert faults.RLDrills("run", 0, 2).armed
    assert all(
        e in faults.WORKER_ENV for e in (faults.KILL_IN_ROLLOUT_ENV, faults.WEIGHT_DIGEST_ENV)
    )


def test_kills_fire_once_per_run_on_the_last_rank() -> None:
    run = f"file:///runs/{uuid.uuid4().hex}"
    drills = faults.RLDrills(run, 1, 2)
    env = {faults.KILL_IN_ROLLOUT_ENV: "3", faults.KILL_IN_UPDATE_ENV: "5"}
    try:
        assert _child(env, run, 1, "in_rollout", 2) == 0  # another step
        assert _child(env, run, 0, "in_rollout", 3) == 0  # not the last rank
        assert _child(env, run, 1, "in_rollout", 3) == -9  # SIGKILL
        assert drills.marker("rollout", 3).exists()
        assert _child(env, run, 1, "in_rollout", 3) == 0  # the resumed attempt samples on
        assert _child(env, run, 1, "in_update", 5, 0, 2) == 0  # after the first micro batch
        assert _child(env, run, 1, "in_update", 5, 1, 2) == -9  # before the last one
        assert _child(env, run, 1, "in_update", 5, 1, 2) == 0
    finally:
        for what, step in (("rollout", 3), ("update", 5)):
            drills.marker(what, step).unlink(missing_ok=True)


class _Wrapped(torch.nn.Module):
    """A model in a wrapper whose parameter names carry `module.`, as DDP's do."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.module = inner


def test_weights_digest_is_every_trainable_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    digest = faults.weights_digest(model)
    assert faults.weights_digest(_Wrapped(model)) == digest  # the wrapper's prefix is not in it
    bits = model[1].bias.data.view(torch.int32)
    bits[0] ^= 1  # one bit of the last parameter
    assert faults.weights_digest(model) != digest
    bits[0] ^= 1
    assert faults.weights_digest(model) == digest
    model[0].weight.requires_grad_(False)  # frozen weights (a LoRA base) are not counted
    frozen = faults.weights_digest(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert faults.weights_digest(model) == frozen != digest


def test_digests_of_a_step(monkeypatch) -> None:
    model = torch.nn.Linear(2, 2)
    assert faults.RLDrills("run", 0, 1).digests(model, ["a"]) == {}  # not asked for
    monkeypatch.setenv(faults.WEIGHT_DIGEST_ENV, "1")
    drills = faults.RLDrills("run", 0, 1)
    sampled = drills.digests(model, ["a"])
    assert sampled["debug/weights_sha256"] == faults.weights_digest(model)
    assert (
        sampled["debug/completions_sha256"]
        != drills.digests(model, ["b"])["debug/completions_sha256"]
    )
    assert set(drills.digests(model, [])) == {"debug/weights_sha256"}  # a reused rollout


def _fsdp_rank(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: the digest of a model before and after FSDP2 shards it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    whole = faults.weights_digest(model)
    fully_shard(model)
    assert type(model[0].weight).__name__ == "DTensor"
    sharded = faults.weights_digest(model)  # collective: each parameter gathered
    local = model[0].weight.to_local().numel()
    Path(f"{out}.{rank}").write_text(json.dumps([whole, sharded, local]))
    dist.destroy_process_group()


def test_weights_digest_gathers_fsdp2_shards(tmp_path) -> None:
    """Under FSDP2 each rank holds half of every parameter; the digest is the whole
    model's on both ranks, the one it had before sharding."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(port, str(tmp_path / "digest")), nprocs=2)
    (w0, s0, n0), (w1, s1, n1) = (
        json.loads((tmp_path / f"digest.{r}").read_text()) for r in range(2)
    )
    assert w0 == w1 == s0 == s1
    assert n0 + n1 == 8 * 6 and n0 < 8 * 6  # the shards were halves
