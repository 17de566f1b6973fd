"""`raylift eval RUN_OR_EXPORT --tasks T ...`: lm-evaluation-harness scores with lm-eval's
own Hugging Face model: the numbers a team compares with the published ones. A table
(markdown and JSON) and a plot of each score against the step are written.

A run folder (local or s3://) with a Ray cluster in reach (--address, RAY_ADDRESS, the
infra stack, the local cluster: as `raylift run` finds one) is scored as a Ray job over
its checkpoints (tools.evaluate.remote), into RUN/eval/. An export folder, or a run
without a cluster or with --local, is scored on this machine over its exports."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from tools.evaluate import exports, remote
from trainer.errors import UserError
from trainer.evaluation import table

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="an export folder (config.json), or a run folder")
    p.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names or YAML paths")
    p.add_argument("--limit", type=int, default=None, help="examples per task (the first N)")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="only these steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if there is one)")
    p.add_argument("--out", type=Path, default=None, help="default: TARGET/eval (local only)")
    p.add_argument("--address", default=None, help="the Ray cluster's dashboard address")
    p.add_argument("--local", action="store_true", help="score the run's exports here")
    p.add_argument("--endpoint-override", help="S3-compatible endpoint of the run's storage")
    p.add_argument("--region", help="S3 region of the run's storage")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from trainer.evaluation.specs import check

        check(args.tasks, strict=True)
        if not args.local and remote.is_run(args.target):
            with contextlib.ExitStack() as stack:
                target = remote.cluster_target(args.address, stack)
                if target is not None:
                    return remote.submit_eval(args, target)
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
