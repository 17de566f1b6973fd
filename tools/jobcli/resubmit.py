"""`submit.py run CONFIG --resubmit`: bring a run back after its head or driver was lost.

Ray does not recover a lost head (or a job whose driver died): the run's state is in its
storage, so the same run name submitted again resumes from its newest complete
checkpoint. `--resubmit` does that safely, unattended (a cron job, a systemd timer, a
loop in a notebook):

1. A run whose journal says it finished is not run again (exit 0, one line).
2. It waits, up to `--wait` seconds, for a cluster to answer at the address: the head's
   replacement comes back at the same address.
3. A live submission of the run (the driver survived, only the laptop lost it) is
   followed, not duplicated.
4. Otherwise it submits the run name again.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from trainer.config import JobConfig
from trainer.errors import UserError

log = logging.getLogger("raylift.submit")


def finished_step(cfg: JobConfig) -> int | None:
    """The step at which the run finished, from its journal in storage; None if it has
    not finished (or never started)."""
    try:
        from trainer.resilience import journal
        from trainer.storage.location import resolve
    except ImportError as exc:
        raise UserError(
            f"--resubmit reads the run's journal in storage and needs {exc.name} "
            "(pip install -e '.[train]')"
        ) from None

    run = resolve(cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region).join(
        cfg.run.name
    )
    done = [r for r in journal.read(run) if r.get("event") == "finished"]
    return int(done[-1]["step"]) if done else None


def wait_for_cluster(connect: Any, address: str, wait_s: float) -> Any:
    """Call `connect()` (which builds a Jobs API client and lists jobs) until the cluster
    answers, for up to `wait_s` seconds; returns the client."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

    told = False

    def note(state: Any) -> None:
        nonlocal told
        if not told:
            print(
                f"waiting for the Ray cluster at {address} to come back "
                f"(up to {wait_s:.0f} s): {str(state.outcome.exception()).splitlines()[0]}",
                file=sys.stderr,
                flush=True,
            )
            told = True

    for attempt in Retrying(
        stop=stop_after_delay(wait_s),
        wait=wait_fixed(2),
        retry=retry_if_exception_type((ConnectionError, OSError, RuntimeError)),
        before_sleep=note,
        reraise=True,
    ):
        with attempt:
            return connect()
    raise AssertionError("unreachable")
