"""Summarise a run from its metrics file: loss, throughput, per-worker peak memory and the
step-time breakdown as one PNG, and the key numbers.

    python -m tools.report STORAGE_PATH/RUN_NAME [--out loss.png] [--endpoint-override URL]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.report.plots import plot
from tools.report.run import load_run, summary_lines


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
