"""The Raylift job CLI on Ray's Jobs API.

    python tools/submit.py run job.yaml [--size 7b|13b|70b] [--as-test] [--no-follow]
                               [--force] [--env KEY[=VALUE] ...] [--set k=v ...]
    python tools/submit.py status [RUN] | logs RUN [--follow] | stop RUN | list | doctor
    python tools/submit.py job.yaml ...            (the same as `run job.yaml ...`)

(`raylift <verb> ...` is the same; tools/cli.py.) This module is the verbs' parser and
dispatch; each verb lives in its own module: run in jobcli.submit, status/logs/stop/list in
jobcli.verbs, doctor in jobcli.doctor. The cluster is `--address`, else RAY_ADDRESS, else
the infra stack (through an SSM port forward this tool opens and closes), else the local
cluster from tools/localcluster.py. Exit status: 0 success, 1 job failed or was stopped,
2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from tools.jobcli import cluster, doctor, submit, verbs
from tools.jobcli.client import client_for
from tools.jobcli.presets import SIZES
from trainer.errors import UserError
from trainer.planner.report import add_arguments as add_plan_arguments

VERBS = ("run", "status", "logs", "stop", "list", "doctor")
VERB_FUNCS = {  # the verbs after `run`: each takes (args, client, target)
    "status": verbs.status,
    "logs": verbs.logs,
    "stop": verbs.stop,
    "list": verbs.list_runs,
    "doctor": doctor.run,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="A bare `submit.py CONFIG ...` means `submit.py run CONFIG ...`.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        help="Jobs API address (default: RAY_ADDRESS, else the infra stack through SSM, "
        "else the local cluster of tools/localcluster.py)",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="verb", required=True)

    r = sub.add_parser("run", parents=[common], help="validate, plan, submit and follow a job")
    r.add_argument("config", help="job YAML")
    r.add_argument(
        "--size",
        choices=sorted(SIZES),
        help="the Ray Llama-2 template's layout for this model size (the config wins)",
    )
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    r.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the job (KEY alone: this shell's value)",
    )
    r.add_argument("--force", action="store_true", help="submit even if the planner refuses")
    add_plan_arguments(r)  # --instance, --rank0-instance, ...: the layout to plan against
    r.add_argument("--as-test", action="store_true", help="one step, no checkpoint")
    r.add_argument("--no-follow", action="store_true", help="submit and return")
    r.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    r.add_argument(
        "--resubmit",
        action="store_true",
        help="after a lost head or driver: wait for the cluster, then resubmit the run name "
        "(it resumes from storage); a finished run is not run again",
    )
    r.add_argument(
        "--wait",
        type=float,
        default=1800.0,
        metavar="S",
        help="with --resubmit: how long to wait for the cluster (default %(default)s s)",
    )

    s = sub.add_parser("status", parents=[common], help="a run's progress, or all runs")
    s.add_argument("run", nargs="?", help="run name (or a submission id)")
    lg = sub.add_parser("logs", parents=[common], help="a run's newest submission's log")
    lg.add_argument("run", help="run name (or a submission id)")
    lg.add_argument("--follow", action="store_true", help="stream until the job ends")
    st = sub.add_parser("stop", parents=[common], help="stop a run's live submission")
    st.add_argument("run", help="run name (or a submission id)")
    sub.add_parser("list", parents=[common], help="runs and their submissions")

    d = sub.add_parser("doctor", parents=[common], help="check every node of the cluster")
    d.add_argument("--config", help="job YAML: check its storage (shared folder or bucket)")
    d.add_argument("--shared", help="shared folder every node must mount and write")
    d.add_argument("--storage", help="storage path to check (local/shared folder or s3://)")
    d.add_argument("--endpoint-override", help="S3-compatible endpoint for --storage")
    d.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in VERBS and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # `submit.py job.yaml ...`, as before the verbs
    args = _parser().parse_args(argv)
    from ray.exceptions import AuthenticationError

    # force: main() may run many times in one process (tests, notebooks); each call logs
    # to the stderr of its own time, never to a stream an earlier caller has closed.
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    where = args.address or "the cluster"
    with contextlib.ExitStack() as stack:
        try:
            if args.verb == "run":
                cfg = submit.run_config(args)  # bad input fails before any cluster is looked up
            target = cluster.resolve(args.address, stack)
            where = target.address
            if args.verb == "run":
                return submit.run(args, cfg, target)
            client = client_for(target.address, target.token)
            return VERB_FUNCS[args.verb](args, client, target)
        except UserError as exc:
            if args.debug:
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except ConnectionError as exc:
            print(f"error: cannot reach the Ray Jobs API at {where}: {exc}", file=sys.stderr)
            return 2
        except AuthenticationError as exc:
            print(
                f"error: the Ray cluster at {where} refused the token "
                f"({str(exc).splitlines()[0]}); set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to "
                "the cluster's token",
                file=sys.stderr,
            )
            return 2
        except KeyboardInterrupt:
            # Ctrl-C leaves the job alone: following it is not owning it.
            print("interrupted; a submitted job keeps running (see `submit.py status`)")
            return 130
