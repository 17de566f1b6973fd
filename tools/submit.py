"""Submit a training job to a Ray cluster through the Jobs API and follow it to the end.

    python tools/submit.py job.yaml [--address http://127.0.0.1:8265] [--set train.lr=1e-4]
                                    [--as-test] [--no-follow]

The config is validated and preflighted here, before anything runs on the cluster; the
exact resolved config that passed is what the job runs (uploaded as the job's
working_dir). Exit status: 0 when the job succeeded, 1 when it failed or was stopped,
2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import JobConfig, load_config
from trainer.errors import UserError
from trainer.plan import add_arguments as add_plan_arguments
from trainer.plan import submit_refusal

log = logging.getLogger("raylift.submit")
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
_STEP = re.compile(r"step (\d+)/(\d+) loss ([0-9.]+)")
_PATH_FIELDS = (
    ("model", "path"),
    ("model", "tokenizer"),
    ("model", "special_tokens"),
    ("data", "train_file"),
    ("data", "eval_file"),
    ("data", "cache_dir"),
    ("storage", "path"),
)


def absolutize(cfg: JobConfig, base: Path) -> JobConfig:
    """Relative paths mean 'relative to where I submit from'; the job runs elsewhere."""
    data = cfg.model_dump(mode="json")
    for section, key in _PATH_FIELDS:
        value = data[section].get(key)
        if value and "://" not in value and not Path(value).is_absolute():
            data[section][key] = str((base / value).resolve())
    return JobConfig.model_validate(data)


def is_local(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname
    return host in ("127.0.0.1", "localhost", "::1")


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


def submit(
    cfg: JobConfig, address: str, env_vars: dict[str, str] | None = None, token: str | None = None
) -> tuple[Any, str]:
    client = client_for(address, token)
    env = {"PYTHONUNBUFFERED": "1", **(env_vars or {})}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "RAYLIFT_DEBUG"):
        if key in os.environ and is_local(address):
            env.setdefault(key, os.environ[key])
    # The folder is packaged and uploaded during the submit call; nothing reads it after.
    with tempfile.TemporaryDirectory(prefix="raylift-submit-") as workdir:
        (Path(workdir) / "job.yaml").write_text(cfg.to_yaml())
        job_id = _submit_with_retry(
            client,
            entrypoint="python -m trainer run job.yaml",
            runtime_env={"working_dir": workdir, "env_vars": env},
            submission_id=f"raylift-{cfg.run.name}-{int(time.time())}",
            metadata={"raylift_run": cfg.run.name},
        )
    return client, job_id


AGENT_NOT_READY = "No available agent to submit job"
SUBMIT_RETRY_S = 90.0
"""How long a submit keeps retrying while the head's job agent is not up yet (a cluster
that just started, or a head that was just replaced)."""


class AgentNotReady(ConnectionError):
    """The Jobs API answered, but the head node's job agent never became available."""


def _submit_with_retry(client: Any, **kwargs: Any) -> str:
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


async def _follow(client: Any, job_id: str, progress: bool) -> dict[str, Any] | None:
    """Stream the job's log; show a step progress bar parsed from rank 0's step lines."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    summary = None
    bar = Progress(
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=False,
    )
    task = None
    with bar:
        async for chunk in client.tail_job_logs(job_id):
            for line in chunk.splitlines():
                if line.startswith("RAYLIFT_SUMMARY "):
                    summary = json.loads(line[len("RAYLIFT_SUMMARY ") :])
                    continue
                if progress:
                    bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
                else:
                    print(line, flush=True)
                m = _STEP.search(line)
                if m:
                    done, total = int(m.group(1)), int(m.group(2))
                    if task is None:
                        task = bar.add_task("train", total=total, loss=m.group(3))
                    bar.update(task, completed=done, total=total, loss=m.group(3))
    return summary


def follow(client: Any, job_id: str, progress: bool = True) -> tuple[str, dict[str, Any] | None]:
    summary = asyncio.run(_follow(client, job_id, progress))
    status = client.get_job_status(job_id)
    # The log stream can end a moment before the status flips; wait for a terminal one.
    deadline = time.monotonic() + 60
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return str(status.value if hasattr(status, "value") else status), summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", DEFAULT_ADDRESS),
        help="Ray dashboard / Jobs API address (default: %(default)s)",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--force", action="store_true", help="submit even if the planner refuses")
    add_plan_arguments(p)  # --instance, --rank0-instance, ...: the layout to plan against
    p.add_argument("--as-test", action="store_true")
    p.add_argument("--no-follow", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    from ray.exceptions import AuthenticationError

    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        overrides = list(args.overrides) + (["train.as_test=true"] if args.as_test else [])
        cfg = absolutize(load_config(args.config, overrides), Path.cwd())
        from trainer.preflight import run_all

        report = run_all(cfg, strict=is_local(args.address))
        for note in report.notes:
            log.info("preflight: %s", note)
        refusal = None if args.force else submit_refusal(cfg, args)
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
        client, job_id = submit(cfg, args.address)
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"error: cannot reach the Ray Jobs API at {args.address}: {exc}", file=sys.stderr)
        return 2
    except AuthenticationError as exc:
        print(
            f"error: the Ray cluster at {args.address} refused the token "
            f"({str(exc).splitlines()[0]}); set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to "
            "the cluster's token",
            file=sys.stderr,
        )
        return 2
    print(f"submitted job {job_id} to {args.address}", flush=True)
    if args.no_follow:
        return 0
    status, summary = follow(client, job_id, progress=not args.no_progress)
    if summary:
        print("RAYLIFT_SUMMARY " + json.dumps(summary), flush=True)
    print(f"job {job_id}: {status}", flush=True)
    if status == "SUCCEEDED":
        return 0
    for line in failure_lines(client, job_id, status):
        print(line, file=sys.stderr)
    return 1


def failure_lines(client: Any, job_id: str, status: str, tail: int = 20) -> list[str]:
    """Why a job did not succeed: Ray's own message, and the end of the job's log (the
    trainer's one-line `error: …` is the last thing a failed job prints)."""
    lines = [f"error: job {job_id} {status}"]
    try:
        message = client.get_job_info(job_id).message
    except RuntimeError:
        message = None
    if message:
        lines.append(f"  ray: {message.strip().splitlines()[-1]}")
    try:
        logs = client.get_job_logs(job_id).rstrip().splitlines()
    except RuntimeError:
        logs = []
    if logs:
        lines.append(f"  last {min(tail, len(logs))} lines of the job's log:")
        lines += [f"  | {x}" for x in logs[-tail:]]
    return lines


if __name__ == "__main__":
    sys.exit(main())
