"""Runs and their submissions, as the Jobs API and the run's storage know them.

A run is what `run.name` names; every `submit.py run` of it is one Ray job, with the id
`raylift-<run>-<n>` (n counts that run's submissions on this cluster). At most one of them
may be live: a second submit while one is PENDING or RUNNING would train two copies into
the same checkpoint folder.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("raylift.submit")
LIVE = frozenset({"PENDING", "RUNNING"})
RUN_KEY = "raylift_run"


def state(info: Any) -> str:
    status = info.status
    return str(getattr(status, "value", status))


def run_of(info: Any) -> str | None:
    return (info.metadata or {}).get(RUN_KEY)


def submissions(jobs: list[Any], run: str) -> list[Any]:
    """The run's submissions, oldest first."""
    mine = [j for j in jobs if run_of(j) == run and j.submission_id]
    return sorted(mine, key=lambda j: (j.start_time or 0, j.submission_id))


def by_run(jobs: list[Any]) -> dict[str, list[Any]]:
    runs: dict[str, list[Any]] = {}
    for job in jobs:
        name = run_of(job)
        if name is not None and job.submission_id:
            runs.setdefault(name, []).append(job)
    return {name: submissions(js, name) for name, js in sorted(runs.items())}


def live(jobs: list[Any]) -> Any | None:
    """The newest PENDING/RUNNING submission among `jobs`, if any."""
    alive = [j for j in jobs if state(j) in LIVE]
    return alive[-1] if alive else None


def next_submission_id(jobs: list[Any], run: str) -> str:
    pattern = re.compile(rf"^raylift-{re.escape(run)}-(\d+)$")
    numbers = [int(m.group(1)) for j in jobs if (m := pattern.match(j.submission_id or ""))]
    return f"raylift-{run}-{max(numbers, default=0) + 1}"


@dataclass
class Progress:
    """What the run's metrics file says about how far it is."""

    step: int | None = None
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    restarts: int = 0
    lost_steps: int = 0
    note: str | None = None  # why nothing could be read, when so
    memory: str | None = None  # the fullest rank at the last logged step
    slowest: str | None = None  # the phase that took most of a step, over the steady run
    rewards: str | None = None  # a preference objective's TRL metrics at the last step
    benchmarks: str | None = None  # train.eval_tasks' newest scores, and their step


PHASE_NAMES = {
    "data": "data wait",
    "fwd_bwd": "forward+backward",
    "optim": "optimizer step",
    "ckpt": "checkpoint stall",
    "eval": "eval",
}


def memory_line(rec: dict[str, Any]) -> str | None:
    """The fullest rank of a metrics record: `rank 3: 21.40 GiB peak (89% of 24.0 GiB)`."""
    if "mem_reserved_gib_max" not in rec:
        return None
    rank = rec["mem_reserved_gib_max_rank"]
    line = f"rank {rank}: {rec['mem_reserved_gib_max']:.2f} GiB peak"
    if rec.get("mem_capacity_gib"):
        line += f" ({rec['mem_peak_pct_max']:.0f}% of {rec['mem_capacity_gib']:.1f} GiB)"
    if rec.get("ooms_max") or rec.get("alloc_retries_max"):
        line += f", {rec['alloc_retries_max']:.0f} allocator retries, {rec['ooms_max']:.0f} OOMs"
    return line


def steady(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steady part of a run's step records: its second half (warm-up, compilation and
    the first checkpoints are behind it)."""
    return steps[len(steps) // 2 :] or steps


def slowest_line(steps: list[dict[str, Any]]) -> str | None:
    """The phase that took most of a step over the steady part of the run (mean over ranks),
    and the rank most often slowest at it. A record's phase times are means over the steps
    since the record before it, so each is weighted by the steps it covers: an eval or a
    checkpoint counts once, spread over the steps it serves, whichever step ran it."""
    window = steady(steps)
    if not window or any(f"t_{p}_s_mean" not in r for r in window for p in PHASE_NAMES):
        return None
    first = steps.index(window[0])
    before = steps[first - 1]["step"] if first else window[0]["step"] - 1
    totals = dict.fromkeys(PHASE_NAMES, 0.0)
    covered = 0
    slow_ranks: dict[str, dict[Any, float]] = {p: {} for p in PHASE_NAMES}
    for rec in window:
        n = max(1, int(rec["step"]) - int(before))
        before = rec["step"]
        covered += n
        for p in PHASE_NAMES:
            t = rec[f"t_{p}_s_mean"] * n
            totals[p] += t
            rank = rec.get(f"t_{p}_s_max_rank")
            slow_ranks[p][rank] = slow_ranks[p].get(rank, 0.0) + t
    means = {p: t / covered for p, t in totals.items()}
    total = sum(means.values()) or 1e-12
    top = max(means, key=lambda p: means[p])
    rank = max(slow_ranks[top], key=lambda r: slow_ranks[top][r])
    return (
        f"{PHASE_NAMES[top]} {means[top]:.3f} s of {total:.3f} s per step "
        f"({means[top] / total:.0%}); slowest rank {rank}"
    )


def submission_run(meta: dict[str, str]) -> Any:
    """The run folder a submission's metadata names (a trainer.storage Location), or None
    when it names no storage or run; raises when the storage cannot be resolved here."""
    from trainer.storage.location import resolve

    if not meta.get("raylift_storage") or not meta.get(RUN_KEY):
        return None
    return resolve(
        meta["raylift_storage"],
        meta.get("raylift_endpoint") or None,
        meta.get("raylift_region") or None,
    ).join(meta[RUN_KEY])


def read_progress(meta: dict[str, str], total: int | None = None) -> Progress:
    """The one place that reads a run's progress (the metrics file today; a run journal
    later). `meta` is the submission's metadata: it names the run's storage."""
    from trainer.observability.metrics import lineage, read_records
    from trainer.storage.location import resolve

    uri = meta.get("raylift_storage")
    if not uri:
        return Progress(note="no storage recorded for this submission")
    try:
        run = resolve(uri, meta.get("raylift_endpoint") or None, meta.get("raylift_region") or None)
        records = read_records(run.join(meta[RUN_KEY], "metrics.jsonl"))
    except Exception as exc:  # a shared-FS path that only the cluster mounts, no creds, …
        return Progress(note=f"metrics not readable from here: {str(exc).splitlines()[0]}")
    steps, lost = lineage(records)
    restarts = sum(1 for r in records if r.get("event") == "resume")
    try:  # the run journal knows restarts from clean resubmissions apart
        from trainer.resilience import journal

        faults = journal.summarize(journal.read(run.join(meta[RUN_KEY])))
        if faults["attempts"]:
            restarts, lost = faults["restarts"], sum(faults["lost_steps"])
    except Exception:  # an older run without a journal, or unreadable from here
        pass
    if total is None and meta.get("raylift_max_steps"):
        total = int(meta["raylift_max_steps"])
    if not steps:
        return Progress(total=total, restarts=restarts, lost_steps=lost)
    last = steps[-1]
    eta = None
    tps = last.get("tokens_per_s")
    if total and "tokens/update" in last and last.get("step_time_s"):
        # online RL: tokens_per_s counts the update's real tokens, tokens_seen does not
        eta = max(total - last["step"], 0) * last["step_time_s"]
    elif total and tps and last.get("tokens_seen"):
        per_step = last["tokens_seen"] / last["step"]
        eta = max(total - last["step"], 0) * per_step / tps
    return Progress(
        step=int(last["step"]),
        total=total,
        loss=last.get("loss"),
        tokens_per_s=tps,
        eta_s=eta,
        restarts=restarts,
        lost_steps=lost,
        memory=memory_line(last),
        slowest=slowest_line(steps),
        rewards=rewards_line(last) or reward_line(steps),
        benchmarks=benchmarks_line(steps),
    )


def rewards_line(record: dict[str, Any]) -> str | None:
    """A preference objective's step (trainer.objectives), by TRL's metric names: how
    often the chosen completion wins, and by how much."""
    if "rewards/accuracies" not in record:
        return None
    return (
        f"accuracies {record['rewards/accuracies']:.2f}, margins "
        f"{record['rewards/margins']:.3f} (chosen {record['rewards/chosen']:.3f}, "
        f"rejected {record['rewards/rejected']:.3f})"
    )


def reward_line(steps: list[dict[str, Any]]) -> str | None:
    """An online RL run's newest rollout (TRL's names: reward, reward_std, each function's
    rewards/<name>/mean) and its step: a step that reused an earlier rollout
    (num_iterations > 1) has none of its own."""
    scored = next((r for r in reversed(steps) if "reward" in r), None)
    if scored is None:
        return None
    parts = [f"reward {scored['reward']:.4f} ± {scored.get('reward_std', 0.0):.4f}"]
    parts += [
        f"{k[8:-5]} {v:.4f}"
        for k, v in sorted(scored.items())
        if k.startswith("rewards/") and k.endswith("/mean")
    ]
    return f"{', '.join(parts)} (step {scored['step']})"


def benchmarks_line(steps: list[dict[str, Any]]) -> str | None:
    """The newest benchmark scores (eval/<task>/<metric>, trainer.evaluation) and the step
    that scored them."""
    scored = next((r for r in reversed(steps) if any(k.startswith("eval/") for k in r)), None)
    if scored is None:
        return None
    values = ", ".join(f"{k[5:]} {v:.4f}" for k, v in sorted(scored.items()) if k[:5] == "eval/")
    return f"{values} (step {scored['step']})"


_STEP_TOTAL = re.compile(r"step \d+/(\d+) loss")


def total_from_logs(logs: str) -> int | None:
    """Rank 0 logs `step N/M`; with `epochs` (not max_steps) M is known only there."""
    found = _STEP_TOTAL.findall(logs[-200_000:])
    return int(found[-1]) if found else None


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
