"""What the RAM tier (checkpoint.memory_every, trainer.checkpoint.memory) buys and costs, on
a local three-node Ray cluster (head + two 1-CPU workers), side by side in one run:

- hard kill: a training worker SIGKILLs itself after step 2 × EVERY + EVERY // 2, half
  an interval past a storage checkpoint (where a kill at a random step lands on
  average); figures: the steps lost, and the seconds from the kill to the first new step
  (the first past the one the kill followed: the run making progress again, restart,
  restore and retrained steps all counted), with a snapshot every step against storage
  only (storage: the local S3 server). Targets: the RAM tier loses ≤ 2 steps, and its
  first new step comes sooner (ratio < 1). The seconds to the restarted attempt's first
  step (new or retrained) are printed beside them.
- throughput: tokens/s with a snapshot every step ÷ tokens/s without. Target ≥ 0.97.

Sizes: RAYLIFT_BENCH_MEMORY_STEPS (the runs' length), RAYLIFT_BENCH_MEMORY_EVERY (the
storage checkpoint interval), RAYLIFT_BENCH_HIDDEN / RAYLIFT_BENCH_LAYERS (the model),
rounds: RAYLIFT_BENCH_REPEATS."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.bench.benchutil import Check, run_benchmark, size, smoke, steady_tokens_per_s
from tests.support.jobs import base_job
from tests.support.ray_jobs import history, recovery_after_self_kill, run_to_end
from tools.tiny import build_all

# Minutes even at smoke size: make bench runs it, make test leaves it out (docs/development.md).
pytestmark = pytest.mark.bench_only

EVERY = size("RAYLIFT_BENCH_MEMORY_EVERY", 25, 5)
KILL_AT = 2 * EVERY + EVERY // 2
STEPS = size("RAYLIFT_BENCH_MEMORY_STEPS", 200, 30, minimum=KILL_AT + 10)


def _job(
    tiny: dict[str, Path],
    root: Path,
    name: str,
    memory_every: int,
    storage: dict[str, str] | None = None,
    **train: Any,
) -> Path:
    data = copy.deepcopy(base_job(tiny, root / "runs", name))
    data["storage"].update(storage or {})
    data["train"].update({"max_steps": STEPS, "eval_every": None, "log_every": 1, **train})
    data["checkpoint"].update({"every_steps": EVERY, "keep_last": 2, "memory_every": memory_every})
    data["run"]["max_failures"] = 3
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _model(tmp_path: Path) -> dict[str, Path]:
    hidden = size("RAYLIFT_BENCH_HIDDEN", 256, 64)
    layers = size("RAYLIFT_BENCH_LAYERS", 4, 2)
    return build_all(tmp_path / "tiny", rows=3000, eval_rows=50, hidden=hidden, layers=layers)


def test_hard_kill_ram_tier_vs_storage_only(ray_cluster, s3_server, tmp_path):
    """Storage is the local S3 server, as on a cluster (S3): a restore from storage
    downloads the checkpoint, one from the RAM tier reads the keepers' memory."""
    tiny = _model(tmp_path)
    storage = {"path": "s3://ckpt/memory-bench", "endpoint_override": s3_server["endpoint"]}

    def kill(memory_every: int):
        def once(i: int) -> dict[str, float]:
            path = _job(tiny, tmp_path, f"hk-{memory_every}-{i}", memory_every, storage)
            got = recovery_after_self_kill(ray_cluster, path, KILL_AT)
            want = "memory-own" if memory_every else "storage"
            assert got.pop("restored_from") == want, got
            return got

        return once

    run_benchmark(
        "memory_tier_recovery",
        title="Hard kill (worker SIGKILL): steps lost and seconds to the first new step",
        commands={"ram_tier": kill(1), "storage_only": kill(0)},
        checks=[
            Check("ram_lost_steps", lambda r: r["ram_tier"]["lost_steps"], 2, False),
            Check("storage_lost_steps", lambda r: r["storage_only"]["lost_steps"]),
            Check("ram_first_new_step_s", lambda r: r["ram_tier"]["new_step_seconds"], unit="s"),
            Check(
                "storage_first_new_step_s",
                lambda r: r["storage_only"]["new_step_seconds"],
                unit="s",
            ),
            Check(
                "first_new_step_ram_over_storage",
                lambda r: r["ram_tier"]["new_step_seconds"] / r["storage_only"]["new_step_seconds"],
                1.0,
                False,
            ),
            Check("ram_restart_first_step_s", lambda r: r["ram_tier"]["seconds"], unit="s"),
            Check("storage_restart_first_step_s", lambda r: r["storage_only"]["seconds"], unit="s"),
        ],
        metric="seconds",
        unit="s",
        setup={
            "checkpoint_every": EVERY,
            "kill_at": KILL_AT,
            "nodes": "head + 2 × 1 CPU",
            "storage": "S3 (SeaweedFS on 127.0.0.1)",
        },
    )


def _snapshot_s(steps: list[dict[str, Any]]) -> float:
    """The RAM tier's stall per step (the `snap` phase) over the second half of the run."""
    rows = [r for r in steps[len(steps) // 2 :] if "t_snap_s_mean" in r]
    return sum(r["t_snap_s_mean"] for r in rows) / max(1, len(rows))


def test_snapshot_every_step_throughput(ray_cluster, tmp_path):
    """Also the per-snapshot cost with the staged state sent from memory (tmpfs, now)
    against staged on the local disk, written, read back and deleted (before)."""
    tiny = _model(tmp_path)

    def run(memory_every: int, staging: str = "memory"):
        def once(i: int) -> dict[str, float]:
            path = _job(tiny, tmp_path, f"tp-{memory_every}-{staging}-{i}", memory_every)
            env = {"RAYLIFT_SNAPSHOT_STAGING": staging}
            cfg, _, _ = run_to_end(ray_cluster, path, env=env)
            steps = history(cfg)[0]
            return {"tokens_per_s": steady_tokens_per_s(steps), "snapshot_s": _snapshot_s(steps)}

        return once

    commands = {"every_step": run(1), "every_step_disk": run(1, "disk"), "off": run(0)}
    checks = [
        Check(
            "tokens_per_s_ratio",
            lambda r: r["every_step"]["tokens_per_s"] / r["off"]["tokens_per_s"],
            0.97,
        ),
        Check(
            "tokens_per_s_ratio_disk_staging",
            lambda r: r["every_step_disk"]["tokens_per_s"] / r["off"]["tokens_per_s"],
        ),
        Check(
            "snapshot_stall_memory_over_disk",
            lambda r: r["every_step"]["snapshot_s"] / r["every_step_disk"]["snapshot_s"],
            1.0,
            higher_is_better=False,
        ),
    ]
    if smoke():  # make test: that the bench runs, not the disk comparison (a run's cost)
        commands.pop("every_step_disk")
        checks = checks[:1]
    run_benchmark(
        "memory_tier_throughput",
        title="Tokens/s with a RAM-tier snapshot every step ÷ without; a snapshot's stall, "
        "staged in memory ÷ on disk",
        commands=commands,
        checks=checks,
        metric="tokens_per_s",
        unit="tokens/s",
        setup={"steps": STEPS, "checkpoint_every": EVERY, "nodes": "head + 2 × 1 CPU"},
    )
