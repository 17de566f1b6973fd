"""gpu-check's verdicts and report: each result row judged against the tolerances, the
printed table, the PNG and report.json. It reads rows, never runs anything, so a unit
test can judge a made-up GPU run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.gpucheck import mfu

TOLERANCE = 0.15
"""Predicted ÷ measured peak device memory must lie in [0.85, 1.15] (GPU runs only)."""
DEVICE_TOLERANCE = 0.10
"""GPU runs: the planner's device-level total must be at least the measured device-level
peak (NVML / mem_get_info: what an OOM sees) and at most 10% above it."""


def judge(result: dict[str, Any], gpu: bool) -> list[str]:
    """Why this job fails the check (empty: it passes)."""
    if result.get("kind") == "mfu" or result.get("strategy") == mfu.CASE:
        return mfu.judge(result, gpu)
    if result.get("error"):
        return [result["error"]]
    problems = []
    losses = result["losses"]
    k = max(1, len(losses) // 3)
    if not losses or sum(losses[-k:]) / k >= sum(losses[:k]) / k:
        problems.append(f"loss did not fall ({losses})")
    if result["resumed_from"] != result["stop_at"]:
        problems.append(
            f"did not resume from its step-{result['stop_at']} checkpoint "
            f"(resumed from {result['resumed_from']})"
        )
    if not result["export_ok"]:
        problems.append(f"export did not reload: {result['export_error']}")
    device = result.get("device_over_measured")
    ratio = result.get("predicted_over_measured")
    if gpu and device is not None:
        if not 1.0 <= device <= 1 + DEVICE_TOLERANCE:
            problems.append(
                f"planner's device-level total ÷ measured device peak = {device:.2f} is outside "
                f"[1.00, {1 + DEVICE_TOLERANCE:.2f}]"
            )
    elif gpu and (ratio is None or abs(ratio - 1) > TOLERANCE):
        problems.append(f"planner predicted ÷ measured = {ratio} is outside ±{TOLERANCE:.0%}")
    return problems


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def table(results: list[dict[str, Any]], gpu: bool) -> str:
    mem = "reserved/alloc MiB" if gpu else "peak RSS MiB"
    head = (
        f"{'gpus':>4} {'strategy':<14} {'params':>7} {'loss':>15} {'tokens/s':>9} {'MFU':>6} "
        f"{mem:>20} {'pred/meas':>9} {'÷bare':>6}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        losses = r.get("losses") or []
        loss = f"{losses[0]:.2f}→{losses[-1]:.2f}" if losses else "-"
        if gpu:
            m = f"{_mib(r.get('max_memory_reserved'))}/{_mib(r.get('max_memory_allocated'))}"
        else:
            m = _mib(r.get("peak_rss"))
        mfu = r.get("mfu")
        ratio = r.get("predicted_over_measured")
        bare = "-" if r.get("vs_bare") is None else f"{r['vs_bare']:.2f}"
        verdict = "PASS" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        lines.append(
            f"{r['world']:>4} {r['strategy']:<14} {r.get('params', 0) / 1e6:>6.1f}M {loss:>15} "
            f"{r.get('tokens_per_s') or 0:>9,.0f} {'-' if mfu is None else f'{mfu:.1%}':>6} "
            f"{m:>20} {'-' if ratio is None else f'{ratio:.2f}':>9} "
            f"{bare:>6}"
            f"{'' if gpu else ' (not judged)'}  {verdict}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, gpu: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\n×{r['world']}" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = ["tab:green" if not r["problems"] else "tab:red" for r in results]
    axes[0].bar(labels, [r.get("tokens_per_s") or 0 for r in results], color=colours)
    axes[0].set_title("tokens/s (all ranks)", fontsize=9)
    if gpu:
        axes[1].bar(labels, [100 * (r.get("mfu") or 0) for r in results], color=colours)
        axes[1].set_title("MFU %", fontsize=9)
    else:
        axes[1].bar(labels, [(r.get("peak_rss") or 0) / 2**20 for r in results], color=colours)
        axes[1].set_title("peak RSS MiB per rank (CPU; not judged)", fontsize=9)
    ratios = [r.get("predicted_over_measured") or 0 for r in results]
    axes[2].bar(labels, ratios, color=colours)
    for y in (1 - TOLERANCE, 1 + TOLERANCE):
        axes[2].axhline(y, color="k", linestyle="--", linewidth=0.8)
    axes[2].set_title(
        "planner predicted ÷ measured peak" + ("" if gpu else " (CPU: not judged)"), fontsize=9
    )
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    fig.suptitle("gpucheck: " + ("GPU" if gpu else "CPU self-check (GPU run still to be done)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    out: Path, gpu: bool, device: str, gpus: int, results: list[dict[str, Any]], total: int
) -> dict[str, Any]:
    complete = len(results) == total
    report = {
        "gpu": gpu,
        "gpu_run_done": gpu and complete,
        "complete": complete,
        "device": device,
        "gpus": gpus,
        "tolerance": TOLERANCE,
        "results": results,
        "passed": complete and all(not r["problems"] for r in results),
    }
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / "report.json")
    return report
