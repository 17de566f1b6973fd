"""`raylift eval`'s outputs, locally or from its Ray job (trainer.evaluation.offline): a
row per scored model (its step, its folder, its scores), written as JSON and as a markdown
table, and a plot of each score against the step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def names(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("eval/")})


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = names(rows)
    head = "| step | model | " + " | ".join(c[5:] for c in cols) + " |"
    rule = "|---|---|" + "---|" * len(cols)
    body = [
        f"| {r['step'] if r['step'] is not None else '-'} | {r['model']} | "
        + " | ".join(f"{r[c]:.4f}" if c in r else "" for c in cols)
        + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body]) + "\n"


def write(rows: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    """eval.json, eval.md and (with two steps or more) eval.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "md": out / "eval.md"}
    paths["json"].write_text(json.dumps(rows, indent=1) + "\n")
    paths["md"].write_text(markdown(rows))
    stepped = [r for r in rows if r["step"] is not None]
    if len(stepped) >= 2:
        paths["png"] = plot(stepped, out / "eval.png")
    return paths


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names(rows):
        have = [r for r in rows if name in r]
        ax.plot([r["step"] for r in have], [r[name] for r in have], "o-", label=name[5:])
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.05)
    ax.set_title("benchmarks over the run's exports")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
