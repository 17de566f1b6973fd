"""Plan a job on the laptop: memory per rank and per node, a verdict per node type, the
cheapest catalog layout that fits and what an epoch costs.

    python -m tools.plan job.yaml [--instance g5.xlarge] [--rank0-instance g5.48xlarge]
                                [--tokens-per-epoch 3.5e6] [--set section.field=value] [--json]
                                [--days 3 --nodes 64]

The same code as `python -m trainer plan` and as submit's refusal (trainer.planner). Under
the plan: the goodput a seeded simulation of faults expects (trainer.planner.faults_sim),
at failure rates the past runs under storage.path moved (trainer.planner.fault_history);
with --days and --nodes, auto against fixed checkpoint intervals at that size. Exit status:
0 when the job fits (or is tight), 2 when it does not or the input is bad.
"""

from __future__ import annotations

import argparse
import json
import sys

from tools.plan.render import render
from trainer.config import load_config
from trainer.errors import UserError
from trainer.planner.report import add_arguments, plan_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--debug", action="store_true")
    add_arguments(p)
    p.add_argument("--days", type=float, help="simulate faults over a run this long (goodput)")
    p.add_argument("--nodes", type=int, help="simulate on this many nodes of the plan's type")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = plan_from_args(cfg, args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from trainer.planner.fault_history import Reading, read_storage
    from trainer.planner.faults_sim import plan_lines  # goodput predicted (issue 49)

    st = cfg.storage  # the past runs there move the failure rates, as they move a run's
    stated = cfg.checkpoint.failure_rate_per_hour is not None  # a drill's: the past not read
    past = Reading() if stated else read_storage(st.path, st.endpoint_override, st.region)
    goodput = plan_lines(cfg, plan, args.days, args.nodes, past=past)
    if args.json:
        print(json.dumps({**plan.to_dict(), "goodput": goodput}, indent=2))
    else:
        render(plan)
        print("\n".join(goodput))
    return 2 if plan.refused else 0
