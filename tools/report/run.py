"""A run's record, read back and summed up: the metrics file's steps (each step once, the
lineage that survived every resume), evaluations, restarts, the journal's account of
faults, the cost and the goodput split; and the lines `raylift report` prints from them.
"""

from __future__ import annotations

from typing import Any

from tools.jobcli.cost import run_lines
from tools.jobcli.goodputlines import measure_run
from tools.jobcli.runs import memory_line, rewards_line, slowest_line, steady
from trainer.checkpoint.export_check import export_lines
from trainer.observability import goodput
from trainer.observability.metrics import lineage, read_records
from trainer.resilience import journal
from trainer.storage.location import resolve


def load_run(run_uri: str, endpoint_override: str | None = None) -> dict[str, Any]:
    run = resolve(run_uri, endpoint_override)
    records = read_records(run.join("metrics.jsonl"))
    steps, wasted = lineage(records)
    evals = [r for r in steps if "eval_loss" in r]
    benchmarks = [r for r in records if r.get("event") == "benchmark"] + [
        r for r in steps if any(k.startswith("eval/") for k in r)
    ]  # before step 1, then the steps that scored train.eval_tasks
    restarts = sum(1 for r in records if r.get("event") == "resume")
    journal_records = journal.read(run)
    faults = journal.summarize(journal_records)
    lost = sum(faults["lost_steps"]) if faults["attempts"] else wasted
    return {
        "cost": run_lines(run, steps, lost),
        "steps": steps,
        "evals": evals,
        "benchmarks": benchmarks,
        "wasted_steps": wasted,
        "restarts": restarts,
        "journal": faults,
        "goodput": measure_run(run, records, journal_records),  # where the paid time went
        "exports": export_lines(run),  # the newest export and the checks made on it
    }


def summary_lines(run: dict[str, Any]) -> list[str]:
    steps = run["steps"]
    if not steps:
        return ["no steps recorded"]
    last = steps[-1]
    window = steady(steps)
    tps = sum(r["tokens_per_s"] for r in window) / len(window)
    lines = [
        f"steps: {last['step']}  (restarts: {run['restarts']}, steps lost to restarts: "
        f"{run['wasted_steps']})",
        f"loss: {steps[0]['loss']:.4f} → {last['loss']:.4f}",
        f"tokens/s (all workers, second half of the run): {tps:,.0f}",
    ]
    if run["evals"]:
        lines.append(
            f"eval loss: {run['evals'][-1]['eval_loss']:.4f} "
            f"(perplexity {run['evals'][-1]['eval_perplexity']:.2f})"
        )
    lines += benchmark_lines(run.get("benchmarks") or [])
    if rewards_line(last):
        lines.append(f"rewards (last step): {rewards_line(last)}")
    rl = [r for r in steps if "reward" in r]  # an online RL run's rollouts
    if rl:
        lines.append(
            f"reward: {rl[0]['reward']:.4f} (step {rl[0]['step']}) → "
            f"{rl[-1]['reward']:.4f} (step {rl[-1]['step']})"
        )
    mem, slow = memory_line(last), slowest_line(steps)
    if mem:
        lines.append(f"fullest worker: {mem}")
    if slow:
        lines.append(f"slowest part of a step (second half of the run): {slow}")
    good = goodput.lines(run["goodput"]) if run.get("goodput") is not None else []
    faults, exports = journal_lines(run.get("journal") or {}), list(run.get("exports") or [])
    return lines + faults + list(run.get("cost") or []) + good + exports


def benchmark_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each benchmark score from its first point (before step 1) to its last."""
    names = sorted({k for r in rows for k in r if k.startswith("eval/")})
    out = []
    for name in names:
        have = [r for r in rows if name in r]
        first, last = have[0], have[-1]
        out.append(
            f"{name[5:]}: {first[name]:.4f} (step {first['step']}) → {last[name]:.4f} "
            f"(step {last['step']})"
        )
    return out


def journal_lines(j: dict[str, Any]) -> list[str]:
    """The run journal's account of faults: what failed, what each restart cost."""
    if not j or not j.get("attempts"):
        return []
    causes = ", ".join(f"{n} {c}" for c, n in sorted(j["failures"].items())) or "none"
    lines = [
        f"attempts: {j['attempts']} (failures: {causes}); lost per restart: "
        f"{j['lost_steps'] or []} steps, {j['lost_s']:.0f} s in all",
    ]
    if j["checkpoints"]:
        save = "n/a" if j["mean_save_s"] is None else f"{j['mean_save_s']:.2f} s"
        up = "n/a" if j["mean_upload_s"] is None else f"{j['mean_upload_s']:.2f} s"
        lines.append(
            f"checkpoints: {j['checkpoints']} (mean save {save}, mean upload {up}, "
            f"upload retries {j['upload_retries']})"
        )
    for p in j["preemptions"]:
        left = "?" if p["deadline_s"] is None else f"{p['deadline_s']:.0f} s"
        lines.append(
            f"spot notice at step {p['step']}: saved in {p['save_s']:.1f} s with {left} left"
        )
    return lines
