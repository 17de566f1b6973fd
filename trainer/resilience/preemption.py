"""The loop's spot-notice component: when to ask Ray for a preemption notice, whether the
step just trained must be checkpointed at once, and riding out the rest of the notice.

A spot notice (a node drain seen by Ray) checkpoints at once; Ray restarts the group off
the node after it, so the steps since the last checkpoint are kept. A rebalance
recommendation on a node of the run (trainer.resilience.rebalance) rides the same flags and
shortens the checkpoint intervals for a while.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from trainer.checkpoint import manager as ckpt_mod
from trainer.errors import CheckpointError
from trainer.resilience.rebalance import RebalanceWatch
from trainer.storage.location import Location
from trainer.storage.retry import retrying

log = logging.getLogger("trainer")


def _patient(where: Location, rt: Any, left: float | None, took: float) -> Location:
    """`where` on a filesystem that retries transient errors as the checkpoint uploads do
    (trainer.storage.retry), for the upload retry budget or what is left of the notice,
    whichever is shorter: the check must not outlast the node it is saving for."""
    budget = float(getattr(rt, "retry_s", 0.0))
    if left is not None:
        budget = min(budget, max(left - took, 0.0))
    return dataclasses.replace(where, fs=retrying(where.fs, budget))


PREEMPTION_CHECK_S = 1.0
"""Seconds between asks for a preemption notice. Ray Train's get_preemption_info() is a
barrier through its synchronization actor (two actor calls per rank), too dear for every
step; Ray itself polls for node drains every 5 s, and a spot notice gives two minutes."""


class PreemptionWatch:
    def __init__(self, rt: Any, enabled: bool, cadence: Any = None):
        """`cadence`: the run's checkpoint cadence (None with fixed intervals), which a
        rebalance recommendation shortens."""
        self.rt = rt
        self.enabled = enabled
        self.notice: dict[str, Any] | None = None
        self._last_check = time.monotonic()
        self.rebalance = RebalanceWatch(rt, cadence, enabled)

    def ask(self) -> list[float]:
        """This rank's flags for the step's first all-reduce (summed over ranks): 1.0 from
        rank 0 to ask Ray after this step (rank 0's clock decides for every rank), and 1.0
        from a rank that found a fresh rebalance notice on its node."""
        due = time.monotonic() - self._last_check >= PREEMPTION_CHECK_S
        return [float(self.rt.rank == 0 and due), self.rebalance.ask()]

    def check(self, asked: float, rebalanced: float, done: int) -> None:
        """Act on a rebalance notice any rank saw (every rank alike), and ask Ray
        (collective) when rank 0 said so, until a notice has come."""
        self.rebalance.agreed(rebalanced, done)
        if self.notice is not None or not self.enabled or asked <= 0:
            return
        self._last_check = time.monotonic()
        self.notice = self.rt.preemption()
        if self.notice is not None and self.rt.rank == 0:
            log.warning(
                "step %d: node preemption notice (ranks %s, %s s left): checkpointing now",
                done,
                self.notice["ranks"],
                "?" if self.notice["deadline_s"] is None else f"{self.notice['deadline_s']:.0f}",
            )

    def emergency(self, is_last: bool) -> bool:
        """Whether this step's checkpoint is an emergency one (the final step's is final)."""
        return self.notice is not None and not is_last

    def ride_out(self, done: int, saving_started: float) -> None:
        """After the emergency checkpoint of `done`: wait until every rank's share is in
        storage, check it is complete, say what it took, journal it, and wait for the
        reclaim (Ray restarts the group elsewhere). Collective.

        Each rank's report returns once its own share (and its earlier uploads) is
        uploaded, not the others': rank 0 used to journal the notice while rank 1 was still
        uploading, and a reclaim at that moment left the step torn (rank 1's manifest
        missing). So the ranks meet first, and the journal's `preemption` record means the
        checkpoint is complete in storage. A checkpoint that is still torn then fails the
        attempt here, which restarts from the newest complete one, rather than riding out
        a notice with nothing whole to resume from. The check reads storage with the
        uploads' retries (`checkpoint.upload_retry_s`, within the notice's time): a brief
        storage error is not a torn checkpoint."""
        assert self.notice is not None
        rt = self.rt
        rt.barrier()  # every rank's manifest is uploaded: its report has returned
        took = time.monotonic() - saving_started
        left = self.notice["deadline_s"]
        if rt.rank == 0:
            where = _patient(rt.run.join(ckpt_mod.dir_name(done)), rt, left, took)
            state, why = ckpt_mod.completeness(where)
            if state is None:
                raise CheckpointError(
                    f"{where.uri}: the emergency checkpoint of step {done} is incomplete "
                    f"after every rank uploaded it ({why}); restarting from the newest "
                    "complete checkpoint"
                )
            log.warning(
                "emergency checkpoint of step %d saved in %.1f s%s",
                done,
                took,
                "" if left is None else f" of the {left:.0f} s left before the reclaim",
            )
            if rt.journal is not None:
                rt.journal.add(
                    "preemption",
                    step=done,
                    ranks=self.notice["ranks"],
                    deadline_s=left,
                    save_s=round(took, 3),
                    margin_s=None if left is None else round(left - took, 3),
                    complete=True,
                )
        rt.wait_out_preemption(None if left is None else left - took)
