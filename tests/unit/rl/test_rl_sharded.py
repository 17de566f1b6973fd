"""GRPO under FSDP2 and ZeRO-3 on 2 ranks (torchrun, gloo, CPU): sampling with the
weights sharded (synced decoding: a rank that is done keeps forwarding until both are)
gives the same completions as DDP's whole weights, and the two steps the same losses,
rewards and KL to the reference (beta 0.04: FSDP2's frozen sharded copy, ZeRO-3's
partitioned engine, DDP's whole copy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.torchrun import torchrun


def _run(strategy: str, tiny, tmp_path: Path) -> list[list[dict]]:
    rows = [{"prompt": f"question {i}: what is {i} plus {i}?"} for i in range(8)]
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / strategy / "steps"
    out.parent.mkdir()
    args = ["-m", "tests.support.rl_worker", strategy, str(tiny["model"]), str(prompts), str(out)]
    proc = torchrun(args, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _read(tmp_path / strategy)


def _read(folder: Path) -> list[list[dict]]:
    return [json.loads((folder / f"steps.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_samples_and_trains_as_ddp(strategy: str, tiny, tmp_path_factory) -> None:
    root = tmp_path_factory.getbasetemp() / "rl_sharded"
    root.mkdir(exist_ok=True)
    ddp = _run("ddp", tiny, root) if not (root / "ddp").exists() else _read(root / "ddp")
    sharded = _run(strategy, tiny, root)
    for rank in range(2):
        for a, b in zip(ddp[rank], sharded[rank], strict=True):
            assert a["ids"] == b["ids"]  # step 2 too: sampled after an update
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["reward"] == a["reward"]
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7)
        assert ddp[rank][0]["kl"] == pytest.approx(
            0.0, abs=1e-7
        )  # the reference starts as the policy
        assert ddp[rank][1]["kl"] > 1e-6  # and stays behind after the update
    assert ddp[0][0]["ids"] != ddp[1][0]["ids"]  # each rank its own prompts
