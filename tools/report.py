"""Summarise a run from its metrics file: loss, throughput, per-worker peak memory and the
step-time breakdown as one PNG, and the key numbers.

python tools/report.py STORAGE_PATH/RUN_NAME [--out loss.png] [--endpoint-override URL]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tools.jobcli.cost import run_lines
from tools.jobcli.goodputlines import measure_run
from tools.jobcli.runs import PHASE_NAMES, memory_line, rewards_line, slowest_line, steady
from trainer.observability import goodput
from trainer.observability.metrics import lineage, read_records
from trainer.resilience import journal
from trainer.storage.location import resolve


def load_run(run_uri: str, endpoint_override: str | None = None) -> dict[str, Any]:
    run = resolve(run_uri, endpoint_override)
    records = read_records(run.join("metrics.jsonl"))
    steps, wasted = lineage(records)
    evals = [r for r in steps if "eval_loss" in r]
    restarts = sum(1 for r in records if r.get("event") == "resume")
    journal_records = journal.read(run)
    faults = journal.summarize(journal_records)
    lost = sum(faults["lost_steps"]) if faults["attempts"] else wasted
    return {
        "cost": run_lines(run, steps, lost),
        "steps": steps,
        "evals": evals,
        "wasted_steps": wasted,
        "restarts": restarts,
        "journal": faults,
        "goodput": measure_run(run, records, journal_records),  # where the paid time went
    }


def plot(run: dict[str, Any], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = run["steps"]
    fig = plt.figure(figsize=(11, 11))
    grid = fig.add_gridspec(3, 2, height_ratios=[3, 3, 1])
    ax1, ax2 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax3, ax4 = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _plot_goodput(fig.add_subplot(grid[2, :]), run.get("goodput"))  # the whole width
    ax1.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss")
    if run["evals"]:
        ax1.plot(
            [r["step"] for r in run["evals"]],
            [r["eval_loss"] for r in run["evals"]],
            "o-",
            label="eval loss",
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_title(title)
    _plot_rewards(ax1, steps)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in steps], [r["tokens_per_s"] for r in steps], color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s (all workers)")
    ax2.set_title("throughput")
    ax2.grid(alpha=0.3)
    _plot_memory(ax3, steps)
    _plot_phases(ax4, steps)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")  # the goodput legend sits below its bar
    plt.close(fig)
    return out


def _plot_rewards(ax: Any, steps: list[dict[str, Any]]) -> None:
    """A preference objective's rewards/accuracies beside its loss, on a 0-1 axis."""
    rows = [r for r in steps if "rewards/accuracies" in r]
    if not rows:
        return
    twin = ax.twinx()
    twin.plot(
        [r["step"] for r in rows],
        [r["rewards/accuracies"] for r in rows],
        color="tab:purple",
        label="rewards/accuracies",
    )
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("rewards/accuracies")
    twin.legend(loc="center right")


def _plot_goodput(ax: Any, g: Any) -> None:
    """Where the paid accelerator time went: one stacked bar, a part per colour."""
    ax.set_title("paid accelerator time (wall × workers)")
    if g is None or g.paid <= 0:
        ax.text(0.5, 0.5, "no goodput: no journal for this run", ha="center")
        ax.set_axis_off()
        return
    left = 0.0
    for part, seconds in g.parts.items():
        if seconds <= 0:
            continue
        share = seconds / g.paid
        ax.barh([0], [share], left=left, label=f"{goodput.LABELS[part]} {share:.1%}")
        left += share
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("share of paid time")
    ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.5))


def _panel(ax: Any, title: str, ylabel: str, rows: list[Any], empty: str) -> bool:
    """A step-axis panel's frame; with no rows, says so in the panel and returns False."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not rows:
        ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
    return bool(rows)


def _plot_memory(ax: Any, steps: list[dict[str, Any]]) -> None:
    """Peak memory per rank (from the records that carry every rank's values), the
    device's capacity as a line."""
    per_rank = [r for r in steps if "per_rank" in r]
    if not _panel(
        ax, "peak memory per worker", "GiB (peak since the previous record)", per_rank,
        "no per-worker records",
    ):  # fmt: skip
        return
    ranks = len(per_rank[-1]["per_rank"]["mem_reserved_gib"])
    for rank in range(ranks):
        pts = [
            (r["step"], r["per_rank"]["mem_reserved_gib"][rank])
            for r in per_rank
            if rank < len(r["per_rank"]["mem_reserved_gib"])
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"rank {rank}")
    cap = per_rank[-1].get("mem_capacity_gib")
    if cap:
        ax.axhline(cap, color="tab:red", linestyle="--", label=f"capacity {cap:.1f} GiB")
    ax.legend(fontsize="small", ncol=2)


def _plot_phases(ax: Any, steps: list[dict[str, Any]]) -> None:
    """Where the step goes: mean seconds per step of each phase (over ranks), stacked."""
    rows = [r for r in steps if "t_fwd_bwd_s_mean" in r]
    title = "step time breakdown (mean over workers)"
    if not _panel(ax, title, "seconds per step", rows, "no step-time records"):
        return
    xs = [r["step"] for r in rows]
    ys = [[r.get(f"t_{p}_s_mean", 0.0) for r in rows] for p in PHASE_NAMES]
    ax.stackplot(xs, ys, labels=list(PHASE_NAMES.values()), alpha=0.85)
    ax.legend(fontsize="small", loc="upper left")


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
    if rewards_line(last):
        lines.append(f"rewards (last step): {rewards_line(last)}")
    mem, slow = memory_line(last), slowest_line(steps)
    if mem:
        lines.append(f"fullest worker: {mem}")
    if slow:
        lines.append(f"slowest part of a step (second half of the run): {slow}")
    good = goodput.lines(run["goodput"]) if run.get("goodput") is not None else []
    return lines + journal_lines(run.get("journal") or {}) + list(run.get("cost") or []) + good


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="the run's folder: <storage.path>/<run.name>")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--endpoint-override", default=None)
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one line")
    args = p.parse_args(argv)
    try:
        run = load_run(args.run, args.endpoint_override)
    except OSError as exc:  # an unreachable bucket, a missing credential: one line
        if args.debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"error: {args.run}: storage not readable ({first[:200]}); check the path, "
            "--endpoint-override and your credentials",
            file=sys.stderr,
        )
        return 2
    if not run["steps"]:
        print(
            f"error: {args.run}: no run here (no metrics.jsonl with a step); give the run's "
            "folder, <storage.path>/<run.name>",
            file=sys.stderr,
        )
        return 2
    for line in summary_lines(run):
        print(line)
    out = args.out or Path("build") / "reports" / (Path(args.run).name + "-loss.png")
    print(f"plot: {plot(run, out, Path(args.run).name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
