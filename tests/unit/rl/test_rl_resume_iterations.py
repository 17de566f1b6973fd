"""Exact resume inside a num_iterations group, without Ray: `python -m trainer run` under
torchrun (2 ranks, gloo, DDP), GRPO with num_iterations 2 and a checkpoint every 3 steps.
Step 3's checkpoint falls inside rollout 1's group (steps 3 and 4): the weights that
sampled it are gone, so it keeps each rank's rollout. A second run in fresh processes on a
copy of the run folder without step 5's checkpoint resumes from step 3, and its steps
4 and 5 give the loss, the grad norm, the completions (step 5 samples again) and the weights
(a digest of every trainable bit, RAYLIFT_FAULT_WEIGHT_DIGEST) of the uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.jobs import write_job
from tests.support.torchrun import torchrun_command
from trainer.observability.metrics import read_records
from trainer.resilience.faults import WEIGHT_DIGEST_ENV
from trainer.storage.location import resolve

REWARD = """
def even_tokens(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
"""
SAME = ("loss", "grad_norm", "reward", "debug/weights_sha256", "debug/completions_sha256")


def _job(tiny, root: Path, reward: Path, prompts: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return write_job(
        tiny,
        root,
        "iters",
        model={"special_tokens": None},
        data={"train_file": str(prompts), "eval_file": None},
        train={
            "objective": "grpo",
            "micro_batch_size": 4,
            "grad_accum": 2,
            "max_steps": 5,
            "eval_every": None,
            "eval_blocks": None,
            "rl": {
                "num_generations": 4,
                "num_iterations": 2,
                "max_completion_length": 6,
                "rewards": [{"function": f"{reward}:even_tokens"}],
            },
        },
        optim={"lr": 3e-2, "warmup_steps": 0, "schedule": "constant"},
        checkpoint={"every_steps": 3, "keep_last": 2, "memory_every": 0},
    )


def _run(job: Path) -> None:
    import subprocess

    cmd, env = torchrun_command(["-m", "trainer", "run", str(job)])
    env[WEIGHT_DIGEST_ENV] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_checkpoint_inside_a_group_resumes_exactly(tiny, tmp_path) -> None:
    reward = tmp_path / "even.py"
    reward.write_text(REWARD)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"question {i}: what is {i} plus {i}?"} for i in range(16)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    _run(_job(tiny, tmp_path / "a", reward, prompts))
    first = tmp_path / "a" / "runs" / "iters"
    kept = sorted(p.relative_to(first).as_posix() for p in first.glob("step_*/rollout/*"))
    # steps 3 and 5 fall inside rollout 1's and 2's groups: each rank keeps its share
    assert kept == [f"step_0000000{s}/rollout/rank_{r}.npz" for s in (3, 5) for r in (0, 1)]

    again = tmp_path / "b" / "runs" / "iters"
    shutil.copytree(first, again)
    shutil.rmtree(again / "step_00000005")
    _run(_job(tiny, tmp_path / "b", reward, prompts))

    records = read_records(resolve(str(again)).join("metrics.jsonl"))
    by = {(r["attempt"], r["step"]): r for r in records if r.get("event") == "train"}
    assert sorted(s for a, s in by if a == 2) == [4, 5]  # resumed from step 3
    for step in (4, 5):
        a, b = by[(1, step)], by[(2, step)]
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}, step
    assert "debug/completions_sha256" in by[(2, 5)]  # step 5 sampled rollout 2 again
    assert "debug/completions_sha256" not in by[(2, 4)]  # step 4 trained the kept one
    assert by[(1, 3)]["debug/weights_sha256"] != by[(1, 4)]["debug/weights_sha256"]
