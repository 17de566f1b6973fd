"""`raylift report` (`python -m tools.report RUN`): summarise a run from what it left in
storage. `run` reads the record and makes the printed lines, `plots` draws the PNG, `cli`
is the verb. The names other tools and the demo use are exported here."""

from tools.report.cli import main
from tools.report.plots import plot
from tools.report.run import journal_lines, load_run, summary_lines

__all__ = ["journal_lines", "load_run", "main", "plot", "summary_lines"]
