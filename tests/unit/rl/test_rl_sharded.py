"""GRPO under FSDP2 on 2 ranks (torchrun, gloo, CPU): sampling with the weights sharded
(synced decoding: a rank that is done keeps forwarding until both are) gives the same
completions as DDP's whole weights, and the two steps the same losses and rewards."""

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
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_fsdp_samples_and_trains_as_ddp(tiny, tmp_path: Path) -> None:
    ddp, fsdp = _run("ddp", tiny, tmp_path), _run("fsdp", tiny, tmp_path)
    for rank in range(2):
        for a, b in zip(ddp[rank], fsdp[rank], strict=True):
            assert a["ids"] == b["ids"]  # step 2 too: sampled after an update
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["reward"] == a["reward"]
    assert ddp[0][0]["ids"] != ddp[1][0]["ids"]  # each rank its own prompts
