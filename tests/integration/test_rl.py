"""Online RL through the production path: one Ray job, 2 workers, DDP, GRPO on the tiny
Llama with a reward it can learn from reward alone (the share of even token ids in its
completion: about 0.5 for the random model, 1.0 at best), written in a Python file the
job names by path. The mean reward goes from its start to at least 0.9 of its maximum;
the metrics carry TRL's names and completions.jsonl a sample with rewards.

Exact resume (trainer.faults' RL drills), with num_iterations 2 (a rollout
serves two steps): one worker is SIGKILLed inside step 7's rollout (sampled, not scored) in
the first attempt, and inside step 8's update (one micro batch's gradients accumulated, the
optimizer step not run) in the second; each attempt resumes from the step-5 checkpoint,
which falls inside rollout 2's group and keeps it (trainer.rollouts.state). Every step an
attempt trains again gives what the earlier attempt's run of it gave: the same
completions (a digest of every rank's completion ids), reward and loss, and bit-identical
weights (a digest of every trainable parameter after the step): step 6 (the kept
rollout's second step) in all three attempts, step 7 (sampled again) in the last two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import write_job
from tests.support.ray_jobs import history, run_to_end
from trainer import faults
from trainer.runtime.worker import run_location

pytestmark = pytest.mark.slow

REWARD = """
def even_tokens(prompts, completions, completion_ids, **columns):
    assert all(columns["topic"][i] == "sums" for i in range(len(prompts)))
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
"""


SAME = ("reward", "loss", "debug/completions_sha256", "debug/weights_sha256")
"""What a step trained again must give as its earlier run did, bit for bit."""


def _by_attempt(records) -> dict[int, dict[int, tuple]]:
    """{attempt: {step: its SAME values}} of every train record."""
    out: dict[int, dict[int, tuple]] = {}
    for r in records:
        if r.get("event") == "train":
            out.setdefault(r["attempt"], {})[r["step"]] = tuple(r.get(k) for k in SAME)
    return out


def test_grpo_learns_a_reward_on_two_workers(ray_cluster, tiny, tmp_path: Path) -> None:
    (tmp_path / "even.py").write_text(REWARD)
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"question": f"question {i}: what is {i} plus {i}?", "topic": "sums"} for i in range(64)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_job(
        tiny,
        tmp_path,
        "grpo",
        model={"special_tokens": None},
        data={"train_file": str(prompts), "eval_file": None, "columns": {"prompt": "question"}},
        train={
            "objective": "grpo",
            "micro_batch_size": 4,
            "grad_accum": 2,  # two micro batches a worker: the update's kill falls between
            "max_steps": 14,
            "eval_every": None,
            "eval_blocks": None,
            "rl": {
                "num_generations": 8,
                "max_completion_length": 6,
                "rewards": [{"function": f"{tmp_path / 'even.py'}:even_tokens"}],
                "log_completions_every": 3,
                "num_iterations": 2,  # a rollout serves two steps: 5's checkpoint keeps one
            },
        },
        optim={"lr": 3e-2, "warmup_steps": 0, "schedule": "constant"},
        checkpoint={"every_steps": 5, "keep_last": 1, "upload": "sync"},
    )
    drills = {
        faults.KILL_IN_ROLLOUT_ENV: "7",
        faults.KILL_IN_UPDATE_ENV: "8",
        faults.WEIGHT_DIGEST_ENV: "1",
    }
    cfg, _, logs = run_to_end(ray_cluster, path, env=drills)
    records, kept, _ = history(cfg)
    marks = faults.RLDrills(run_location(cfg).uri, 1, 2)
    assert marks.marker("rollout", 7).exists() and marks.marker("update", 8).exists()
    by = _by_attempt(records)
    # attempt 1 died in step 7's rollout, attempt 2 in step 8's update, both after step 5
    assert (sorted(by[1]), sorted(by[2]), min(by[3])) == (list(range(1, 7)), [6, 7], 6)
    assert by[1][6] == by[2][6] == by[3][6], (by[1][6], by[2][6], by[3][6])
    assert by[2][7] == by[3][7], (by[2][7], by[3][7])
    assert len({by[3][s][3] for s in (6, 7, 8)}) == 3  # the weights move every step
    for what, step in (("rollout", 7), ("update", 8)):
        marks.marker(what, step).unlink()
    assert [r["step"] for r in kept if "loss" in r] == list(range(1, 15)), logs[-3000:]
    steps = [r for r in kept if "reward" in r]  # the steps that sampled
    assert [r["step"] for r in steps] == list(range(1, 15, 2))
    start = sum(r["reward"] for r in steps[:2]) / 2
    end = sum(r["reward"] for r in steps[-3:]) / 3
    assert start < 0.7 and end >= 0.9, [round(r["reward"], 3) for r in steps]
    last = steps[-1]
    for name in ("reward_std", "rewards/even_tokens/mean", "completions/mean_length", "entropy"):
        assert name in last, name
    assert last["rewards/even_tokens/mean"] == pytest.approx(last["reward"])
    run = Path(cfg.storage.path) / cfg.run.name
    sample = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in sample} == {3, 9}  # 3 from the first attempt
    assert all(0.0 <= s["rewards"]["even_tokens"] <= 1.0 for s in sample)
