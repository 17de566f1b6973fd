"""`raylift eval` (`python -m tools.evaluate RUN_OR_EXPORT --tasks ...`): benchmark scores
after a run. `exports` finds what to score (one export folder, or every export of a run),
`table` writes the table and the plot, `cli` is the verb."""

from tools.evaluate.cli import main

__all__ = ["main"]
