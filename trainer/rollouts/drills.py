"""The seam through which fault drills reach inside an RL step (a SIGKILL in the middle of
a rollout or of the update, a digest of the weights and completions to compare attempts).

Rollouts and objectives sit below trainer.resilience, which owns the drills
(trainer.faults); these no-op hooks are what a run has until an attempt arms
real ones, so a step calls them unconditionally and never branches on a drill."""

from __future__ import annotations

from typing import Any


class Drills:
    """No drill: every hook does nothing."""

    def in_rollout(self, step: int) -> None:
        """Step `step` (1-based) has sampled this rank's completions, not yet scored them."""

    def in_update(self, step: int, micro: int, micros: int) -> None:
        """Step `step` is about to run micro batch `micro` (0-based) of `micros`: every
        earlier one's backward is done, the optimizer step is still to come."""

    def digests(self, model: Any, completions: list[str]) -> dict[str, str]:
        """Metrics that fingerprint the weights after a step and the step's completions
        (`completions`: this rank's digests of the rollouts since the last report).
        Collective when armed; nothing here."""
        return {}
