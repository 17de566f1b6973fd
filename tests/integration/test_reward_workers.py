"""Rewards as Ray tasks (train.rl.reward_workers) on the session's local cluster, called
from a driver of its own as the rollout feed calls them (no training job): the values
come back in the completions' order from two tasks in two worker processes, and a reward
that raises or hangs stops with the one line that names the reward and the row; the hung
task's worker process is killed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.support.ray_jobs import run_driver

pytestmark = pytest.mark.slow

REWARDS = textwrap.dedent(
    """
    import os
    import threading
    from pathlib import Path

    def index(prompts, completions, answer, **kw):
        return [float(c[1:]) + float(a) / 10 for c, a in zip(completions, answer)]

    def pid(prompts, completions, **kw):
        return [float(os.getpid())] * len(completions)

    def raises_on_c3(prompts, completions, **kw):
        return [1 / (0 if c == "c3" else 1) for c in completions]

    def hangs_on_c1(prompts, completions, **kw):
        if "c1" in completions:
            with Path(__file__).with_name("hung.pids").open("a") as f:
                f.write(f"{os.getpid()} ")
            threading.Event().wait()
        return [0.0] * len(completions)
    """
)

DRIVER = """
import json, os, sys
import psutil
import ray
from trainer.config.rl import RewardSpec
from trainer.rewards.runner import RewardError, Rewards

address, folder = sys.argv[1], sys.argv[2]
ray.init(address=address, log_to_driver=False, logging_level="WARNING")
n = 5
args = ([f"p{i}" for i in range(n)], [f"c{i}" for i in range(n)],
        {"answer": [str(i) for i in range(n)]}, [[i] for i in range(n)])

def score(*names, timeout=60.0):
    specs = [RewardSpec(function=f"{folder}/rewards.py:{name}") for name in names]
    try:
        return Rewards(specs, timeout, workers=2).score(*args)
    except RewardError as e:
        return str(e)

out = {
    "driver": os.getpid(),
    "ok": score("index", "pid"),
    "raises": score("index", "raises_on_c3"),
    "hangs": score("hangs_on_c1", timeout=2.0),
}
# still connected, so the job's workers live on unless ray.cancel(force=True) killed them
pids = f"{folder}/hung.pids"
hung = [int(x) for x in open(pids).read().split()] if os.path.exists(pids) else []
_, alive = psutil.wait_procs([psutil.Process(p) for p in hung if psutil.pid_exists(p)], 60)
out["hung"], out["alive"] = hung, [p.pid for p in alive]
print(json.dumps(out))
"""


def test_reward_tasks_score_in_order_and_stop_on_a_bad_reward(ray_cluster, tmp_path: Path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    out = json.loads(run_driver(ray_cluster, DRIVER, tmp_path).strip().splitlines()[-1])

    ok = out["ok"]
    assert isinstance(ok, list), out
    assert [row[0] for row in ok] == [pytest.approx(i * 1.1) for i in range(5)]
    pids = [int(row[1]) for row in ok]
    # chunks of 3 and 2 rows, each scored whole by its own task, neither in the driver
    assert pids[:3] == [pids[0]] * 3 and pids[3:] == [pids[3]] * 2
    assert len({pids[0], pids[3], out["driver"]}) == 3

    assert out["raises"] == (
        "train.rl.rewards[1] (" + f"{tmp_path}/rewards.py:raises_on_c3) raised "
        "ZeroDivisionError: division by zero on prompt 'p3' and completion 'c3'; fix the "
        "function (a reward is never replaced by 0)"
    )
    assert out["hangs"].startswith(
        f"train.rl.rewards[0] ({tmp_path}/rewards.py:hangs_on_c1) ran past "
        "train.rl.reward_timeout_s = 2 s on prompt 'p1' and completion 'c1'"
    )
    # the chunk's task and the row search's task hung; ray.cancel(force=True) killed both
    # workers (and their threads) while the driver was still connected
    assert len(out["hung"]) == 2 and out["alive"] == [], out
