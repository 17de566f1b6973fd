"""The Ray Jobs API client: its token, and a submit that waits out a starting head.

Ray's Jobs API runs arbitrary code, so Raylift clusters require a token (Ray's token auth);
every verb reaches the cluster through `client_for`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("raylift.submit")

AGENT_NOT_READY = "No available agent to submit job"
SUBMIT_RETRY_S = 90.0
"""How long a submit keeps retrying while the head's job agent is not up yet (a cluster
that just started, or a head that was just replaced)."""


class AgentNotReady(ConnectionError):
    """The Jobs API answered, but the head node's job agent never became available."""


def auth_headers(token: str | None = None) -> dict[str, str] | None:
    """The Jobs API is token-authenticated (Ray's token auth, on by default in Raylift
    clusters): the token comes from the argument, RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH."""
    token = token or os.environ.get("RAY_AUTH_TOKEN")
    if not token and os.environ.get("RAY_AUTH_TOKEN_PATH"):
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser().read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else None


def client_for(address: str, token: str | None = None) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers(token))


def submit_with_retry(client: Any, **kwargs: Any) -> str:
    """Submit, retrying only the one transient answer a starting head gives; every other
    error is final at once."""
    from tenacity import (
        RetryError,
        Retrying,
        retry_if_exception,
        stop_after_delay,
        wait_exponential,
    )

    def transient(exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and AGENT_NOT_READY in str(exc)

    def note(state: Any) -> None:
        log.info("the cluster's job agent is not up yet; retrying the submit …")

    retrying = Retrying(
        retry=retry_if_exception(transient),
        stop=stop_after_delay(SUBMIT_RETRY_S),
        wait=wait_exponential(multiplier=1, max=10),
        before_sleep=note,
    )
    try:
        return retrying(client.submit_job, **kwargs)
    except RetryError:
        raise AgentNotReady(
            f"the head node's job agent did not become available in {SUBMIT_RETRY_S:.0f}s "
            "(the Jobs API answers with 'No available agent'); check the head node's "
            "dashboard_agent.log"
        ) from None
