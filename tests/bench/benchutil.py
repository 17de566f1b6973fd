"""Helpers for the benchmarks (run with `make bench`, never in `make test`). Each
benchmark writes build/bench/<name>.json and a PNG, Raylift and its baseline side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "bench"


def write_result(name: str, result: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\n{name}: {json.dumps(result, indent=2)}\n→ {path}")
    return path


def bar_chart(name: str, title: str, labels: list[str], values: list[float], unit: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, values, color=["tab:blue", "tab:gray", "tab:orange"][: len(values)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel(unit)
    ax.set_title(title)
    fig.tight_layout()
    path = OUT / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
