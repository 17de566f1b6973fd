"""`make demo` (`raylift demo`, `python -m tools.demo`): the production path end to end on
this machine. `cli` runs it (assets, a local Ray cluster, submit, follow, report), `job`
is the job it submits, `promises` what it checks on what the run left behind."""

from tools.demo.cli import main
from tools.demo.job import JOB
from tools.demo.promises import broken_promises

__all__ = ["JOB", "broken_promises", "main"]
