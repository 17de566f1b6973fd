"""`python -m trainer agent`: the spot-notice node agent, one per node.

EC2 announces a spot interruption two minutes ahead, in the instance metadata service
(IMDS) only; nothing tells Ray. The agent polls IMDSv2 and, on a notice, drains its own
Ray node through the GCS (the call behind `ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`), with a deadline a margin
before the notice's time. Ray Train's preemption watcher sees the drain and
`ray.train.get_preemption_info()` reports it to the training loop, which checkpoints at
once. A rebalance recommendation is written where the node's training ranks look for it
(trainer.resilience.rebalance: the running job shortens its checkpoint intervals for a
while) and logged; it drains the node only with `--drain-on-rebalance`.

The agent must never take the node down with it: a metadata service or GCS that does not
answer is retried (tenacity) and logged once per outage, and the loop carries on.

Which node is its own: `--node-id` if given; else the node whose cloud instance id (Ray's
`RAY_CLOUD_INSTANCE_ID`, which the Raylift entrypoint sets from the metadata) is this
instance's; else the one alive node on this host's IP (one Ray node per EC2 instance).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import BaseModel, ValidationError

from trainer.resilience.raynode import (
    NodeNotFound,
    default_gcs_address,
    drain_node,
    find_own_node,
    gcs_client,
    host_ip,
)

log = logging.getLogger("raylift.agent")

DEFAULT_ENDPOINT = "http://169.254.169.254"
DEFAULT_INTERVAL_S = 5.0
# The notice comes 120 s ahead; the drain deadline is this much earlier, so the loop's
# emergency checkpoint is meant to be done ~15 s before EC2 takes the instance.
DEFAULT_MARGIN_S = 15.0
TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
# "Terminated" once the Auto Scaling group has started to end this instance (it then waits in
# Terminating:Wait on infra's drain hook until the agent completes the lifecycle action).
LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
# How long infra's drain hook holds a terminating instance (infra/components/pool.py).
DEFAULT_LIFECYCLE_TIMEOUT_S = 300.0
TOKEN_TTL_S = 21600  # IMDSv2's maximum (6 hours)
# A token is replaced when this little of its life is left (or a tenth of a short TTL).
TOKEN_REFRESH_S = 60.0
# How long one drain is retried before the agent tries again at the next poll.
DRAIN_RETRY_S = 30.0


class ImdsError(Exception):
    """The metadata service did not answer, or answered with an error: worth retrying."""


class SpotNotice(BaseModel):
    """`/latest/meta-data/spot/instance-action`: {"action": "terminate", "time": "…Z"}."""

    action: str
    time: datetime


class RebalanceNotice(BaseModel):
    """`/latest/meta-data/events/recommendations/rebalance`: {"noticeTime": "…Z"}."""

    noticeTime: datetime  # AWS spells it so


# ---- the metadata service -------------------------------------------------------------------


class ImdsClient:
    """IMDSv2: a session token from a PUT, sent with every GET; renewed before it expires
    and whenever the service answers 401 (a token it no longer knows)."""

    def __init__(
        self, endpoint: str = DEFAULT_ENDPOINT, ttl_s: int = TOKEN_TTL_S, timeout_s: float = 2.0
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_expiry = 0.0

    def _call(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except (urllib.error.URLError, OSError) as exc:
            raise ImdsError(f"{self.endpoint}: {getattr(exc, 'reason', exc)}") from exc

    def _fresh_token(self) -> str:
        margin = min(TOKEN_REFRESH_S, self.ttl_s / 10)
        if self._token is None or time.monotonic() >= self._token_expiry - margin:
            status, body = self._call("PUT", TOKEN_PATH, {TTL_HEADER: str(self.ttl_s)})
            if status != 200 or not body:
                raise ImdsError(f"{self.endpoint}: token request answered {status}")
            self._token, self._token_expiry = body.strip(), time.monotonic() + self.ttl_s
        return self._token

    def get(self, path: str) -> str | None:
        """The body, or None where the path does not exist (404: no notice). A service
        that does not answer is tried three times within about a second."""
        from tenacity import Retrying, retry_if_exception_type, stop_after_attempt
        from tenacity import wait_exponential as backoff

        for attempt in Retrying(
            retry=retry_if_exception_type(ImdsError),
            stop=stop_after_attempt(3),
            wait=backoff(multiplier=0.2, max=1.0),
            reraise=True,
        ):
            with attempt:
                return self._get_once(path)
        raise AssertionError("unreachable: tenacity reraises")

    def _get_once(self, path: str) -> str | None:
        for _ in range(2):
            status, body = self._call("GET", path, {TOKEN_HEADER: self._fresh_token()})
            if status != 401:
                break
            self._token = None  # expired or unknown to the service: get a new one, once
        if status == 200:
            return body
        if status == 404:
            return None
        raise ImdsError(f"GET {path} answered {status}")


# ---- the agent ------------------------------------------------------------------------------


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class AgentOptions:
    imds_endpoint: str = DEFAULT_ENDPOINT
    interval_s: float = DEFAULT_INTERVAL_S
    margin_s: float = DEFAULT_MARGIN_S
    node_id: str | None = None
    gcs_address: str | None = None
    drain_on_rebalance: bool = False
    # Where a rebalance notice is written for the node's training ranks (None: the default
    # of trainer.resilience.rebalance, RAYLIFT_REBALANCE_FILE or the node's temp folder).
    rebalance_file: str | None = None
    lifecycle_timeout_s: float = DEFAULT_LIFECYCLE_TIMEOUT_S
    # infra's node.env (RAYLIFT_LIFECYCLE_HOOK, RAYLIFT_ASG_NAME, RAYLIFT_INSTANCE_ID,
    # RAYLIFT_REGION): which lifecycle action to complete once the node is drained.
    node_env: dict[str, str] = field(default_factory=dict)


class Agent:
    def __init__(self, options: AgentOptions, stop: threading.Event | None = None) -> None:
        self.options = options
        self.stop = stop or threading.Event()
        self.imds = ImdsClient(options.imds_endpoint)
        self._node_id = options.node_id
        self._instance_id: str | None = None
        # Notices (raw bodies) already announced in the log, and those fully handled: a
        # notice stays up until the instance goes, and is logged and drained once.
        self._logged: set[str] = set()
        self._done: set[str] = set()
        self._imds_down = False

    # -- which node

    def _gcs_address(self) -> str:
        address = self.options.gcs_address or default_gcs_address()
        if not address:
            raise NodeNotFound("no Ray address yet (RAY_ADDRESS unset, no ray_current_cluster)")
        return address

    def _own_node(self) -> str:
        if self._node_id is None:
            if self._instance_id is None:
                self._instance_id = self.imds.get(INSTANCE_ID_PATH)
            address = self._gcs_address()
            self._node_id = find_own_node(address, self._instance_id, host_ip(address))
            log.info("this node is Ray node %s", self._node_id)
        return self._node_id

    # -- draining

    def _drain(self, deadline: datetime | None, message: str) -> None:
        from tenacity import Retrying, stop_after_delay
        from tenacity import wait_exponential as backoff

        for attempt in Retrying(
            stop=stop_after_delay(DRAIN_RETRY_S),
            wait=backoff(multiplier=0.5, max=5.0),
            reraise=True,
        ):
            with attempt:
                node_id = self._own_node()
                remaining = None if deadline is None else deadline.timestamp() - time.time()
                drain_node(self._gcs_address(), node_id, remaining, message)
        log.warning(
            "drained Ray node %s: reason PREEMPTION, deadline %s, message %r",
            node_id,
            "none" if remaining is None else f"{_iso(deadline)} (in {remaining:.0f}s)",
            message,
        )

    # -- one poll

    def poll_once(self) -> None:
        try:
            spot = self.imds.get(SPOT_PATH)
            rebalance = self.imds.get(REBALANCE_PATH)
            target_state = self.imds.get(LIFECYCLE_PATH) if self._lifecycle_hook() else None
        except ImdsError as exc:
            if not self._imds_down:
                log.warning(
                    "metadata service unreachable (%s); still polling every %gs",
                    exc,
                    self.options.interval_s,
                )
            self._imds_down = True
            return
        if self._imds_down:
            log.info("metadata service answers again")
            self._imds_down = False
        if spot is not None and spot not in self._done:
            self._on_spot(spot)
        if rebalance is not None and rebalance not in self._done:
            self._on_rebalance(rebalance)
        if target_state == "Terminated" and "lifecycle" not in self._done:
            self._on_terminating()

    def _on_spot(self, body: str) -> None:
        try:
            notice = SpotNotice.model_validate(json.loads(body))
        except (ValueError, ValidationError):
            log.warning("ignoring a spot notice that does not parse: %r", body[:200])
            self._done.add(body)
            return
        deadline = datetime.fromtimestamp(
            max(notice.time.timestamp() - self.options.margin_s, time.time() + 1), UTC
        )
        message = f"EC2 spot interruption notice: {notice.action} at {_iso(notice.time)}"
        if body not in self._logged:
            log.warning(
                "spot notice: %s at %s (in %.0fs); draining this Ray node, deadline %s "
                "(margin %gs)",
                notice.action,
                _iso(notice.time),
                notice.time.timestamp() - time.time(),
                _iso(deadline),
                self.options.margin_s,
            )
            self._logged.add(body)
        if self._drain_once(body, deadline, message):
            self._complete_lifecycle(deadline)

    def _on_rebalance(self, body: str) -> None:
        try:
            notice = RebalanceNotice.model_validate(json.loads(body))
            when = _iso(notice.noticeTime)
        except (ValueError, ValidationError):
            when = body[:200]
        if body not in self._logged:
            self._tell_the_job(body)
            log.warning(
                "rebalance recommendation at %s: %s",
                when,
                "draining this Ray node (no deadline)"
                if self.options.drain_on_rebalance
                else "the job's checkpoint intervals shorten (--drain-on-rebalance drains)",
            )
            self._logged.add(body)
        if not self.options.drain_on_rebalance:
            self._done.add(body)
            return
        self._drain_once(body, None, f"EC2 rebalance recommendation at {when}")

    def _tell_the_job(self, body: str) -> None:
        """The notice, for the training ranks on this node (trainer.resilience.rebalance);
        a file that cannot be written is logged, never fatal."""
        from pathlib import Path

        from trainer.resilience.rebalance import write_notice

        path = Path(self.options.rebalance_file) if self.options.rebalance_file else None
        try:
            write_notice(body, path)
        except OSError as exc:
            log.error("could not write the rebalance notice for the job: %s", exc)

    def _drain_once(self, body: str, deadline: datetime | None, message: str) -> bool:
        try:
            self._drain(deadline, message)
        except Exception as exc:
            log.error("could not drain this Ray node (%s); trying again at the next poll", exc)
            return False
        self._done.add(body)
        return True

    # -- the Auto Scaling drain hook (infra's node.env names it)

    def _lifecycle_hook(self) -> str | None:
        env = self.options.node_env
        if env.get("RAYLIFT_LIFECYCLE_HOOK") and env.get("RAYLIFT_ASG_NAME"):
            return env["RAYLIFT_LIFECYCLE_HOOK"]
        return None

    def _on_terminating(self) -> None:
        """The group is ending this instance (scale-in, health replacement): drain with the
        time the hook holds it, then let it go."""
        deadline = datetime.fromtimestamp(
            time.time() + max(self.options.lifecycle_timeout_s - self.options.margin_s, 1), UTC
        )
        if "lifecycle" not in self._logged:
            log.warning(
                "Auto Scaling is terminating this instance (hook %s); draining this Ray node, "
                "deadline %s",
                self._lifecycle_hook(),
                _iso(deadline),
            )
            self._logged.add("lifecycle")
        message = f"Auto Scaling termination (lifecycle hook {self._lifecycle_hook()})"
        if self._drain_once("lifecycle", deadline, message):
            self._complete_lifecycle(deadline)

    def _node_idle(self) -> bool:
        """Nothing holds this node's CPUs or GPUs any more (the training workers left)."""
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(gcs_client(self._gcs_address()))
        for node in state.node_states:
            if node.node_id.hex() == self._node_id:
                return all(
                    node.available_resources.get(k, 0) >= v
                    for k, v in node.total_resources.items()
                    if k in ("CPU", "GPU")
                )
        return True  # gone from the table: nothing runs on it

    def _complete_lifecycle(self, deadline: datetime) -> None:
        """Once the node is idle (or its drain deadline has come), tell the group it may end
        the instance: `complete-lifecycle-action ... --lifecycle-action-result CONTINUE`."""
        hook = self._lifecycle_hook()
        if hook is None or "lifecycle-complete" in self._done:
            return
        env = self.options.node_env
        instance_id = env.get("RAYLIFT_INSTANCE_ID") or self._instance_id
        log.info(
            "lifecycle action %s: completing once this node's CPUs and GPUs are free, by %s",
            hook,
            _iso(deadline),
        )
        while time.time() < deadline.timestamp() and not self.stop.is_set():
            try:
                if self._node_idle():
                    break
            except Exception as exc:
                log.debug("could not read this node's resources: %s", exc)
            self.stop.wait(self.options.interval_s)
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            boto3.client(
                "autoscaling", region_name=env.get("RAYLIFT_REGION") or None
            ).complete_lifecycle_action(
                LifecycleHookName=hook,
                AutoScalingGroupName=env["RAYLIFT_ASG_NAME"],
                InstanceId=instance_id,
                LifecycleActionResult="CONTINUE",
            )
        except (BotoCoreError, ClientError) as exc:
            # No pending action (a spot interruption the group has not acted on) is normal.
            log.info("lifecycle action %s not completed: %s", hook, exc)
        else:
            log.warning("completed lifecycle action %s for %s: CONTINUE", hook, instance_id)
        self._done.add("lifecycle-complete")

    def run(self) -> None:
        log.info(
            "node agent: polling %s every %gs (drain margin %gs)",
            self.options.imds_endpoint,
            self.options.interval_s,
            self.options.margin_s,
        )
        if self._lifecycle_hook():
            import boto3  # noqa: F401 - imported now, not while a notice's seconds run

        while not self.stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # the agent must outlive anything one poll meets
                log.error("poll failed: %s: %s", type(exc).__name__, exc)
            self.stop.wait(self.options.interval_s)


# ---- CLI ------------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--imds-endpoint",
        default=DEFAULT_ENDPOINT,
        help=f"instance metadata service (default {DEFAULT_ENDPOINT})",
    )
    p.add_argument(
        "--interval",
        type=_positive,
        default=DEFAULT_INTERVAL_S,
        help="seconds between polls (default %(default)s)",
    )
    p.add_argument(
        "--margin",
        type=_non_negative,
        default=DEFAULT_MARGIN_S,
        help="drain deadline = notice time minus this many seconds (default %(default)s)",
    )
    p.add_argument("--node-id", help="hex id of the Ray node to drain (default: this host's)")
    p.add_argument("--gcs-address", help="GCS host:port (default: RAY_ADDRESS or ray start's)")
    p.add_argument(
        "--drain-on-rebalance",
        action="store_true",
        help="drain on a rebalance recommendation too (default: log it only)",
    )
    p.add_argument(
        "--lifecycle-timeout",
        type=_positive,
        default=DEFAULT_LIFECYCLE_TIMEOUT_S,
        help="seconds the Auto Scaling drain hook holds a terminating instance "
        "(default %(default)s)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def main(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    options = AgentOptions(
        imds_endpoint=args.imds_endpoint,
        interval_s=args.interval,
        margin_s=args.margin,
        node_id=args.node_id,
        gcs_address=args.gcs_address,
        drain_on_rebalance=args.drain_on_rebalance,
        lifecycle_timeout_s=args.lifecycle_timeout,
        node_env={k: v for k, v in os.environ.items() if k.startswith("RAYLIFT_")},
    )
    Agent(options, stop).run()
    return 0
