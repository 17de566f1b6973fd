"""`python -m trainer run|validate|plan|data job.yaml [--set section.field=value ...]`,
`python -m trainer eval RUN --tasks ...` (a run's checkpoints scored, trainer.evaluation),
`python -m trainer doctor` (the cluster check, trainer.runtime.doctor), and `python -m trainer
agent` (the spot-notice node agent, trainer.resilience.agent).

The same command runs as a Ray job's entrypoint (it starts a TorchTrainer on the cluster)
and under torchrun (it detects the torchrun environment and trains in-process), so Slurm
and Kubernetes users keep the same loop and the same checkpoints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from trainer.config import load_config
from trainer.errors import UserError
from trainer.observability.logs import SUMMARY_MARK, print_marked, setup_logging

log = logging.getLogger("trainer")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("run", "validate, tokenize and train"),
        ("validate", "validate the config and inputs, then exit"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("config", help="job YAML")
        s.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.FIELD=VALUE",
            help="override a config field",
        )
        s.add_argument(
            "--as-test",
            action="store_true",
            help="one forward/backward and one step, no checkpoint",
        )
        s.add_argument("--debug", action="store_true", help="show tracebacks")
    s = sub.add_parser("plan", help="predict memory per rank and node, verdicts and cost")
    s.add_argument("config", help="job YAML")
    s.add_argument("--set", dest="overrides", action="append", default=[])
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--debug", action="store_true", help="show tracebacks")
    from trainer.planner.report import add_arguments

    add_arguments(s)
    from trainer.objectives.preview import add_arguments as data_arguments

    data_arguments(sub.add_parser("data", help="the data as the model sees it, on a sample"))
    s = sub.add_parser("doctor", help="check every alive node of the cluster (a Ray job)")
    s.add_argument("--shared", help="shared folder every node must mount and write")
    s.add_argument("--bucket", help="s3://bucket/prefix every node must write, read, delete")
    s.add_argument("--endpoint-override", help="S3-compatible endpoint for --bucket")
    s.add_argument("--region", help="S3 region for --bucket")
    s.add_argument("--debug", action="store_true", help="show tracebacks")
    s = sub.add_parser("eval", help="score a run's checkpoints with lm-eval (the eval job)")
    s.add_argument("run", help="the run folder (storage.path/run.name), local or s3://")
    s.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names or YAML paths")
    s.add_argument("--steps", type=int, nargs="+", default=None, help="only these steps")
    s.add_argument("--limit", type=int, default=None, help="examples per task (the first N)")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--endpoint-override", help="S3-compatible endpoint of the run's storage")
    s.add_argument("--region", help="S3 region of the run's storage")
    s.add_argument("--debug", action="store_true", help="show tracebacks")
    from trainer.resilience import agent

    agent.add_arguments(sub.add_parser("agent", help="the spot-notice node agent (one per node)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.debug)
    if args.command == "agent":
        from trainer.resilience.agent import main as agent_main

        return agent_main(args)
    try:
        if args.command == "doctor":
            from trainer.runtime import doctor

            return doctor.main(
                {
                    "shared": args.shared,
                    "bucket": args.bucket,
                    "endpoint": args.endpoint_override,
                    "region": args.region,
                }
            )
        if args.command == "eval":
            from trainer.checkpoint.manager import completeness, list_checkpoints
            from trainer.evaluation.offline import score_run

            def complete(run: object) -> list:
                return [(s, c) for s, c in list_checkpoints(run) if completeness(c)[0]]

            score_run(
                args.run,
                args.tasks,
                complete,
                args.steps,
                args.limit,
                args.batch_size,
                args.endpoint_override,
                args.region,
            )
            return 0
        if args.command == "data":
            from trainer.objectives.preview import run as data_preview

            return data_preview(args, sys.stdout)
        as_test = getattr(args, "as_test", False)
        overrides = list(args.overrides) + (["train.as_test=true"] if as_test else [])
        cfg = load_config(args.config, overrides)
        if args.command == "plan":
            from trainer.planner.report import format_plan, plan_from_args

            plan = plan_from_args(cfg, args)
            print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
            return 2 if plan.refused else 0
        if args.command == "validate":
            from trainer.preflight import run_all

            report = run_all(cfg, strict=True)
            for note in report.notes:
                print(f"note: {note}")
            print(
                f"{args.config}: ok (global batch {cfg.global_batch}, "
                f"{cfg.tokens_per_step} tokens/step)"
            )
            return 0
        from trainer.runtime.launch import run_job

        summary = run_job(cfg)
        if os.environ.get("RANK", "0") == "0":
            print_marked(SUMMARY_MARK, summary)
        return 0
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug:
            if _write_hangs():
                traceback.print_exc()
                _exit_now_if_a_write_hangs(1)
            raise
        cause = _root_cause(exc)
        if isinstance(cause, UserError):
            print(f"error: {cause}", file=sys.stderr)
            return 2
        print(
            f"error: {type(cause).__name__}: {cause} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        _exit_now_if_a_write_hangs(1)
        return 1


def _write_hangs() -> bool:
    staging = sys.modules.get("trainer.storage.staging")  # imported by training, not by the CLI
    return staging is not None and staging.stuck()


def _exit_now_if_a_write_hangs(code: int) -> None:
    """A checkpoint write given up as hung still holds its thread, which a normal exit
    would wait for forever (torchrun would never see this rank fail): leave at once."""
    if _write_hangs():
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)


def _root_cause(exc: BaseException) -> BaseException:
    """Ray wraps worker exceptions; the user's problem is the innermost one."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        inner = inner or getattr(exc, "controller_failure", None)  # StopOnUserError's
        if inner is None:
            errors = getattr(exc, "worker_failures", None)
            if isinstance(errors, dict) and errors:
                inner = next(iter(errors.values()))
        if inner is None or not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


if __name__ == "__main__":
    sys.exit(main())
