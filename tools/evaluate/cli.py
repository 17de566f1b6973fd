"""`raylift eval RUN_OR_EXPORT --tasks T ...`: lm-evaluation-harness scores of an export
folder, or of every export of a run (or the chosen steps), on this machine, with
lm-eval's own Hugging Face model: the numbers a team compares with the published ones.
A table (markdown and JSON) and a plot of each score against the step are written."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tools.evaluate import exports, table
from trainer.errors import UserError

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="an export folder (config.json), or a run folder")
    p.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names or YAML paths")
    p.add_argument("--limit", type=int, default=None, help="examples per task (the first N)")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="only these steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if there is one)")
    p.add_argument("--out", type=Path, default=None, help="default: TARGET/eval")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from trainer.evaluation.specs import check

        check(args.tasks, strict=True)
        found = exports.find(args.target, args.steps)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [score(step, model, args) for step, model in found]
    out = args.out or Path(args.target) / "eval"
    paths = table.write(rows, out)
    print(table.markdown(rows), end="")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def score(step: int | None, model: Path, args: argparse.Namespace) -> dict:
    """One model's row: its step, its folder and its scores."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from trainer.evaluation.tasks import evaluate, scores

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"scoring {model} (step {step}) on {', '.join(args.tasks)} …", flush=True)
    lm = HFLM(pretrained=str(model), device=device, batch_size=args.batch_size, dtype="auto")
    results = evaluate(lm, args.tasks, args.limit)
    return {"step": step, "model": str(model), **scores(results or {})}
