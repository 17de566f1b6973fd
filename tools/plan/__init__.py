"""`raylift plan` (`python -m tools.plan`): plan a job on the laptop, with no torch, Ray,
numpy or pyarrow. `cli` parses and plans (trainer.planner does the figures), `render`
draws the tables. `main` is the verb's entry, importable as `tools.plan.main`."""

from tools.plan.cli import main

__all__ = ["main"]
