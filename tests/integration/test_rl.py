"""Online RL through the production path: one Ray job, 2 workers, DDP, GRPO on the tiny
Llama with a reward it can learn from reward alone (the share of even token ids in its
completion: about 0.5 for the random model, 1.0 at best), written in a Python file the
job names by path. The mean reward goes from its start to at least 0.9 of its maximum;
the metrics carry TRL's names and completions.jsonl a sample with rewards. One worker is
SIGKILLed after step 7; the group resumes from the step-5 checkpoint and samples steps 6
and 7 again: the same completions, so the same rewards and losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import write_job
from tests.support.ray_jobs import history, run_to_end

pytestmark = pytest.mark.slow

REWARD = """
def even_tokens(prompts, completions, completion_ids, **columns):
    assert all(columns["topic"][i] == "sums" for i in range(len(prompts)))
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
"""


def _attempts(records, steps: list[int]) -> tuple[list, list]:
    """(reward, loss) of each step in the first attempt and in the resumed one."""
    by = {(r.get("attempt"), r["step"]): (r["reward"], r["loss"]) for r in records if "reward" in r}
    return [by[(1, s)] for s in steps], [by[(2, s)] for s in steps]


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
            "micro_batch_size": 8,
            "max_steps": 14,
            "eval_every": None,
            "eval_blocks": None,
            "rl": {
                "num_generations": 8,
                "max_completion_length": 6,
                "rewards": [{"function": f"{tmp_path / 'even.py'}:even_tokens"}],
                "log_completions_every": 7,
            },
        },
        optim={"lr": 3e-2, "warmup_steps": 0, "schedule": "constant"},
        checkpoint={"every_steps": 5, "keep_last": 1, "upload": "sync"},
    )
    cfg, _, logs = run_to_end(ray_cluster, path, env={"RAYLIFT_FAULT_KILL_AFTER_STEP": "7"})
    records, kept, _ = history(cfg)
    first, resumed = _attempts(records, [6, 7])
    assert first == resumed  # (reward, loss) of steps 6 and 7, bit for bit
    steps = [r for r in kept if "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, 15)), logs[-3000:]
    start = sum(r["reward"] for r in steps[:2]) / 2
    end = sum(r["reward"] for r in steps[-3:]) / 3
    assert start < 0.7 and end >= 0.9, [round(r["reward"], 3) for r in steps]
    last = steps[-1]
    for name in ("reward_std", "rewards/even_tokens/mean", "completions/mean_length", "entropy"):
        assert name in last, name
    assert last["rewards/even_tokens/mean"] == pytest.approx(last["reward"])
    run = Path(cfg.storage.path) / cfg.run.name
    sample = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in sample} == {7, 14}
    assert all(0.0 <= s["rewards"]["even_tokens"] <= 1.0 for s in sample)
