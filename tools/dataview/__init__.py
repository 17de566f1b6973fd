"""`raylift data job.yaml`: the data as the model will see it, on the laptop, before launch.

A thin door to `trainer.objectives.preview` (the same report as `python -m trainer data` on the
cluster): each source's shape and mapped fields, the counts of a sample, and its first
rows as tokens with the trained ones marked.
"""

from tools.dataview.cli import main

__all__ = ["main"]
