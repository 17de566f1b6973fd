"""`raylift report`'s PNG: loss (and eval loss, a preference objective's rewards, an RL
run's reward), throughput, peak memory per worker, the step-time breakdown, and where the
paid accelerator time went, in one figure drawn from `tools.report.run.load_run`'s record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.jobcli.runs import PHASE_NAMES
from trainer.observability import goodput


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
    _plot_rl_reward(ax1, steps)
    _plot_benchmarks(ax1, run.get("benchmarks") or [])
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


def _plot_rl_reward(ax: Any, steps: list[dict[str, Any]]) -> Any:
    """An online RL run's mean reward beside its loss (which sits near 0 by construction),
    with reward_std as a band: the curve RL users watch. Returns the reward axis."""
    rows = [r for r in steps if "reward" in r]
    if not rows:
        return None
    twin = ax.twinx()
    x = [r["step"] for r in rows]
    mean = [r["reward"] for r in rows]
    std = [r.get("reward_std", 0.0) for r in rows]
    twin.plot(x, mean, color="tab:red", label="reward")
    low = [m - s for m, s in zip(mean, std, strict=True)]
    high = [m + s for m, s in zip(mean, std, strict=True)]
    twin.fill_between(x, low, high, color="tab:red", alpha=0.15, label="± reward_std")
    twin.set_ylabel("reward")
    twin.legend(loc="upper right")
    return twin


def _plot_benchmarks(ax: Any, rows: list[dict[str, Any]]) -> None:
    """train.eval_tasks' scores (eval/<task>/<metric>) beside the loss, on a 0-1 axis:
    the first point is the model before step 1."""
    names = sorted({k for r in rows for k in r if k.startswith("eval/")})
    if not names:
        return
    twin = ax.twinx()
    for name in names:
        have = [r for r in rows if name in r]
        twin.plot([r["step"] for r in have], [r[name] for r in have], "s--", label=name[5:])
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("benchmark score")
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
