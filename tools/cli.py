"""`raylift <verb> ...`: every Raylift tool under one installed command.

Each verb hands the rest of its command line to one tool's own `main(argv)`, so a verb
takes exactly the flags of the script it stands for (`raylift plan job.yaml --json` is
`python -m tools.plan job.yaml --json`). The tools are imported only when their verb runs:
`raylift --help` needs none of them, and `raylift plan` stays a laptop command (no torch,
no Ray).
"""

from __future__ import annotations

import argparse
import importlib
import sys

JOB_VERBS = ("run", "status", "logs", "stop", "list", "doctor")
"""The job CLI's verbs (tools/submit.py): its own parser takes the verb too."""

VERBS: dict[str, tuple[str, str]] = {
    # verb: (the entry module whose main(argv) runs it, its line in `raylift --help`)
    "run": ("tools.submit", "validate, plan, submit and follow a job"),
    "status": ("tools.submit", "a run's progress, or a table of all runs"),
    "logs": ("tools.submit", "a run's newest submission's log (--follow to stream it)"),
    "stop": ("tools.submit", "stop a run's live submission"),
    "list": ("tools.submit", "runs and their submissions"),
    "doctor": ("tools.submit", "check every node of the cluster"),
    "data": ("tools.dataview", "the data as the model sees it: shapes, counts, rows marked"),
    "plan": ("tools.plan", "memory per rank and node, a verdict, the cheapest layout, its cost"),
    "image": ("tools.image", "build, push and lock the training images"),
    "report": ("tools.report", "summarise a run from its metrics: numbers and a PNG"),
    "eval": ("tools.evaluate", "benchmark scores of an export, or of a run's exports by step"),
    "demo": ("tools.demo", "the production path end to end on a local Ray cluster"),
    "gpu-check": (
        "tools.gpucheck.driver",
        "train every strategy on this machine's GPUs and judge it",
    ),
}


def _parser() -> argparse.ArgumentParser:
    """For `raylift --help` only: each verb's own parser does the rest."""
    width = max(map(len, VERBS))
    verbs = "\n".join(f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items())
    return argparse.ArgumentParser(
        prog="raylift",
        usage="raylift VERB [ARGS ...]",
        description=f"Every Raylift tool under one command.\n\nverbs:\n{verbs}",
        epilog="`raylift VERB --help` shows a verb's own options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _parser().print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(
            f"error: raylift has no verb {verb!r}; one of: {', '.join(VERBS)} (raylift --help)",
            file=sys.stderr,
        )
        return 2
    module, _ = VERBS[verb]
    # The tools' parsers name themselves after argv[0]: `usage: raylift plan ...`.
    sys.argv[0] = "raylift" if verb in JOB_VERBS else f"raylift {verb}"
    entry = importlib.import_module(module)
    return entry.main([verb, *rest] if verb in JOB_VERBS else rest)


if __name__ == "__main__":
    raise SystemExit(main())
