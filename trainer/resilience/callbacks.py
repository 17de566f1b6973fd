"""Ray Train controller callbacks (they run on the head, in the controller process)."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from ray.train import UserCallback

from trainer.resilience.journal import Journal
from trainer.storage.location import resolve

log = logging.getLogger(__name__)


_PEER_LOST = (
    r"Connection closed by peer|Connection reset by peer|remote worker crash"
    r"|remote worker hanging|remote process exited|Read timeout"
)


def failure_cause(exc: BaseException) -> str:
    """preempted | node_lost | worker_died | error, from what Ray reports for a rank."""
    inner = getattr(exc, "health_check_failure", None)  # WorkerHealthCheckFailedError
    if inner is not None:
        exc = inner
    if getattr(exc, "preempted", False):
        return "preempted"
    text = str(exc)
    if re.search(r"node (has )?died|node .* (is )?dead|raylet .* died", text, re.I):
        return "node_lost"
    # A collective that lost its peer: the peer (a worker, or its node) died or stopped
    # answering, not this rank. gloo reports a peer whose node was killed either as a closed
    # connection or, when the socket never saw the close, as a read timeout.
    if re.search(_PEER_LOST, text):
        return "worker_died"
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError) or "worker process has died" in text:
        return "worker_died"
    return "error"


_SEVERITY = ("preempted", "node_lost", "worker_died", "error")


class FailureJournal(UserCallback):
    """Writes each worker-group failure, with its cause, to the run journal."""

    def __init__(self, storage_path: str, endpoint: str | None, region: str | None, name: str):
        self.where = (storage_path, endpoint, region, name)
        self._journal: Journal | None = None
        self._seen: set[tuple[Any, ...]] = set()

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        try:
            sig = tuple(
                sorted((r, type(e).__name__, str(e)[:200]) for r, e in worker_exceptions.items())
            )
            if sig in self._seen:
                return  # the controller polls a failed group more than once
            self._seen.add(sig)
            if self._journal is None:
                path, endpoint, region, name = self.where
                run = resolve(path, endpoint, region).join(name)
                self._journal = Journal(run, f"controller-{int(time.time() * 1000)}-{os.getpid()}")
            causes = {r: failure_cause(e) for r, e in worker_exceptions.items()}
            cause = min(causes.values(), key=_SEVERITY.index)
            first = next(iter(worker_exceptions.values()))
            lines = [x.strip() for x in str(first).splitlines() if x.strip()]
            self._journal.add(
                "failure",
                cause=cause,
                ranks=sorted(worker_exceptions),
                causes={str(r): c for r, c in causes.items()},
                message=(lines[-1] if lines else type(first).__name__)[:300],
            )
        except Exception as exc:  # a journal must never take the controller down
            log.warning("failure journal not written: %s", exc)


class StopOnUserError(UserCallback):
    """Ends the run on a worker's `NotRetried` error (a failed export check) instead of
    letting Ray Train retry the attempt: raised from this hook, the error reaches the
    controller as a non-retryable ControllerError, which `fit()` raises with the worker's
    error inside. Listed after FailureJournal, so the failure is journaled first."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        from trainer.errors import not_retried

        for rank in sorted(worker_exceptions):
            error = not_retried(worker_exceptions[rank])
            if error is not None:
                log.error("rank %d: %s (not retried: a restart would repeat it)", rank, error)
                raise error
