"""The Raylift job CLI on Ray's Jobs API.

    python tools/submit.py run job.yaml [--size 7b|13b|70b] [--as-test] [--no-follow]
                               [--force] [--env KEY[=VALUE] ...] [--set k=v ...]
    python tools/submit.py status [RUN] | logs RUN [--follow] | stop RUN | list | doctor
    python tools/submit.py job.yaml ...            (the same as `run job.yaml ...`)

The config is validated, preflighted and planned here, before anything runs on the
cluster; the exact resolved config that passed is what the job runs (uploaded as the
job's working_dir). The cluster is `--address`, else RAY_ADDRESS, else the infra stack
(through an SSM port forward this tool opens and closes), else the local cluster from
tools/localcluster.py. Exit status: 0 success, 1 job failed or was stopped, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.jobcli import cluster, runs
from tools.jobcli.presets import SIZES, preset_overrides
from trainer.config import JobConfig, load_config
from trainer.errors import UserError
from trainer.observability.logs import SUMMARY_MARK, find_marked, print_marked
from trainer.planner.report import add_arguments as add_plan_arguments
from trainer.planner.report import submit_refusal

log = logging.getLogger("raylift.submit")
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

    def absolute(value: str) -> str:
        if value and "://" not in value and not Path(value).is_absolute():
            return str((base / value).resolve())
        return value

    for section, key in _PATH_FIELDS:
        value = data[section].get(key)
        if isinstance(value, str):
            data[section][key] = absolute(value)
        elif isinstance(value, list):  # a mix of data sources
            data[section][key] = [
                absolute(v) if isinstance(v, str) else {**v, "path": absolute(v["path"])}
                for v in value
            ]
    return JobConfig.model_validate(data)


def is_local(address: str) -> bool:
    """An address on this machine. (A port forward is on this machine too: callers that
    know where the address came from use cluster.Target.local instead.)"""
    return cluster.is_loopback(address)


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


class RunIsLive(UserError):
    """A submission of this run is still PENDING or RUNNING; a second would train into the
    same checkpoint folder at the same time."""


STORAGE_CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)
DRIVER_MEMORY = 2 * 2**30
"""Memory reserved for the job's driver (it tokenizes the data and runs Ray Train's
controller) on the head, where Ray puts a driver anyway: the head has no CPUs for training
workers, and the reservation keeps two drivers from overcommitting it."""


def job_env(cfg: JobConfig, names: list[str] | None = None) -> dict[str, str]:
    """The job's environment: what the user named (`--env K=V`, or `--env K` for this
    shell's value), plus the storage credentials only where the storage needs them from
    here: an S3-compatible endpoint (MinIO, SeaweedFS) is not covered by the nodes' IAM
    role. Nothing else of this shell leaks into the cluster."""
    env = {"PYTHONUNBUFFERED": "1"}
    if os.environ.get("RAYLIFT_DEBUG"):
        env["RAYLIFT_DEBUG"] = os.environ["RAYLIFT_DEBUG"]
    data_paths = [src.path for w in ("train", "eval") for src in cfg.data.sources(w)]
    s3_paths = (cfg.storage.path, cfg.model.path, *data_paths)
    if cfg.storage.endpoint_override and any(str(x).startswith("s3://") for x in s3_paths):
        env.update({k: os.environ[k] for k in STORAGE_CREDENTIALS if k in os.environ})
    for item in names or []:
        key, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--env {item}: expected KEY=VALUE or KEY (a variable name)")
        if not eq:
            if key not in os.environ:
                raise UserError(f"--env {key}: not set in this shell; write --env {key}=VALUE")
            value = os.environ[key]
        env[key] = value
    return env


def driver_placement(address: str, token: str | None = None) -> dict[str, Any]:
    """Entrypoint resources that keep the driver on the head with memory reserved there.
    Asking only for memory would let Ray place the driver on any node (a GPU worker's RAM
    is the offloaded optimizer's), so the head is named by its node id. A head that does
    not report enough memory gets no reservation: the job must stay schedulable."""
    try:
        from ray.util.state import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        api = StateApiClient(address=address, headers=auth_headers(token))
        nodes = api.list(
            StateResource.NODES,
            options=ListApiOptions(detail=True, filters=[("state", "=", "ALIVE")]),
            raise_on_missing_output=False,
        )
    except Exception as exc:  # placement is an optimisation; Ray's default is the head
        log.debug("driver placement: %s", exc)
        return {}
    for node in nodes:
        node = node if isinstance(node, dict) else node.__dict__
        if node.get("is_head_node"):
            memory = float((node.get("resources_total") or {}).get("memory", 0))
            if memory < 2 * DRIVER_MEMORY:
                return {}
            return {
                "entrypoint_memory": DRIVER_MEMORY,
                "entrypoint_label_selector": {"ray.io/node-id": node["node_id"]},
            }
    return {}


def _runtime_env(workdir: str, env: dict[str, str], local: bool) -> dict[str, Any]:
    runtime_env: dict[str, Any] = {"working_dir": workdir, "env_vars": env}
    if local:
        # A local cluster runs this checkout's trainer; a remote one runs its image's.
        import trainer

        runtime_env["py_modules"] = [str(Path(trainer.__file__).resolve().parent)]
        runtime_env["excludes"] = ["__pycache__", "*.pyc"]
    return runtime_env


def submit(
    cfg: JobConfig,
    address: str,
    env_vars: dict[str, str] | None = None,
    token: str | None = None,
    local: bool | None = None,
) -> tuple[Any, str]:
    """Submit `python -m trainer run` for this config. Refused (RunIsLive) while another
    submission of the same run is PENDING or RUNNING; the id is `raylift-<run>-<n>`."""
    from tools.jobcli import runs

    client = client_for(address, token)
    env = {**job_env(cfg), **(env_vars or {})}
    metadata = {
        runs.RUN_KEY: cfg.run.name,
        "raylift_storage": cfg.storage.path,
        "raylift_endpoint": cfg.storage.endpoint_override or "",
        "raylift_region": cfg.storage.region or "",
        "raylift_max_steps": str(cfg.train.max_steps or ""),
    }
    placement = driver_placement(address, token)
    # The folder is packaged and uploaded during the submit call; nothing reads it after.
    with tempfile.TemporaryDirectory(prefix="raylift-submit-") as workdir:
        (Path(workdir) / "job.yaml").write_text(cfg.to_yaml())
        for _ in range(3):
            mine = runs.submissions(client.list_jobs(), cfg.run.name)
            busy = runs.live(mine)
            if busy is not None:
                raise RunIsLive(
                    f"run {cfg.run.name} is already {runs.state(busy)} as job "
                    f"{busy.submission_id}; follow it with `submit.py logs {cfg.run.name} "
                    f"--follow`, or stop it with `submit.py stop {cfg.run.name}`"
                )
            try:
                job_id = _submit_with_retry(
                    client,
                    entrypoint="python -m trainer run job.yaml",
                    runtime_env=_runtime_env(
                        workdir, env, is_local(address) if local is None else local
                    ),
                    submission_id=runs.next_submission_id(mine, cfg.run.name),
                    metadata=metadata,
                    **placement,
                )
                return client, job_id
            except RuntimeError as exc:
                if "already exists" not in str(exc):
                    raise
                # Another submit of this run took the id first: look again.
        raise UserError(f"run {cfg.run.name}: could not get a submission id (concurrent submits)")


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


async def _follow(
    client: Any, job_id: str, progress: bool, echo: bool = True
) -> dict[str, Any] | None:
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

    def take(line: str) -> None:
        nonlocal summary, task
        found, line = find_marked(line, SUMMARY_MARK)
        if found is not None:
            summary = found
            if not line.strip():
                return
        if not echo:
            return
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

    with bar:
        # Ray's tail sends what the log file holds so far, so a chunk can end inside a
        # line (the driver still writing it): that part waits for the rest of its line.
        partial = ""
        async for chunk in client.tail_job_logs(job_id):
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                for piece in line.splitlines() or [""]:
                    take(piece)
        for piece in partial.splitlines():
            take(piece)
    return summary


def follow(
    client: Any, job_id: str, progress: bool = True, echo: bool = True
) -> tuple[str, dict[str, Any] | None]:
    summary = asyncio.run(_follow(client, job_id, progress and echo, echo))
    status = client.get_job_status(job_id)
    # The log stream can end a moment before the status flips; wait for a terminal one.
    deadline = time.monotonic() + 60
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return str(status.value if hasattr(status, "value") else status), summary


VERBS = ("run", "status", "logs", "stop", "list", "doctor")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="submit.py",
        description=__doc__.splitlines()[0],
        epilog="A bare `submit.py CONFIG ...` means `submit.py run CONFIG ...`.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        help="Jobs API address (default: RAY_ADDRESS, else the infra stack through SSM, "
        "else the local cluster of tools/localcluster.py)",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="verb", required=True)

    r = sub.add_parser("run", parents=[common], help="validate, plan, submit and follow a job")
    r.add_argument("config", help="job YAML")
    r.add_argument(
        "--size",
        choices=sorted(SIZES),
        help="the Ray Llama-2 template's layout for this model size (the config wins)",
    )
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    r.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the job (KEY alone: this shell's value)",
    )
    r.add_argument("--force", action="store_true", help="submit even if the planner refuses")
    add_plan_arguments(r)  # --instance, --rank0-instance, ...: the layout to plan against
    r.add_argument("--as-test", action="store_true", help="one step, no checkpoint")
    r.add_argument("--no-follow", action="store_true", help="submit and return")
    r.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    r.add_argument(
        "--resubmit",
        action="store_true",
        help="after a lost head or driver: wait for the cluster, then resubmit the run name "
        "(it resumes from storage); a finished run is not run again",
    )
    r.add_argument(
        "--wait",
        type=float,
        default=1800.0,
        metavar="S",
        help="with --resubmit: how long to wait for the cluster (default %(default)s s)",
    )

    s = sub.add_parser("status", parents=[common], help="a run's progress, or all runs")
    s.add_argument("run", nargs="?", help="run name (or a submission id)")
    lg = sub.add_parser("logs", parents=[common], help="a run's newest submission's log")
    lg.add_argument("run", help="run name (or a submission id)")
    lg.add_argument("--follow", action="store_true", help="stream until the job ends")
    st = sub.add_parser("stop", parents=[common], help="stop a run's live submission")
    st.add_argument("run", help="run name (or a submission id)")
    sub.add_parser("list", parents=[common], help="runs and their submissions")

    d = sub.add_parser("doctor", parents=[common], help="check every node of the cluster")
    d.add_argument("--config", help="job YAML: check its storage (shared folder or bucket)")
    d.add_argument("--shared", help="shared folder every node must mount and write")
    d.add_argument("--storage", help="storage path to check (local/shared folder or s3://)")
    d.add_argument("--endpoint-override", help="S3-compatible endpoint for --storage")
    d.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in VERBS and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # `submit.py job.yaml ...`, as before the verbs
    args = _parser().parse_args(argv)
    from ray.exceptions import AuthenticationError

    # force: main() may run many times in one process (tests, notebooks); each call logs
    # to the stderr of its own time, never to a stream an earlier caller has closed.
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    where = args.address or "the cluster"
    with contextlib.ExitStack() as stack:
        try:
            if args.verb == "run":
                cfg = _run_config(args)  # bad input fails before any cluster is looked up
            target = cluster.resolve(args.address, stack)
            where = target.address
            if args.verb == "run":
                return _run(args, cfg, target)
            client = client_for(target.address, target.token)
            return VERB_FUNCS[args.verb](args, client, target)
        except UserError as exc:
            if args.debug:
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except ConnectionError as exc:
            print(f"error: cannot reach the Ray Jobs API at {where}: {exc}", file=sys.stderr)
            return 2
        except AuthenticationError as exc:
            print(
                f"error: the Ray cluster at {where} refused the token "
                f"({str(exc).splitlines()[0]}); set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to "
                "the cluster's token",
                file=sys.stderr,
            )
            return 2
        except KeyboardInterrupt:
            # Ctrl-C leaves the job alone: following it is not owning it.
            print("interrupted; a submitted job keeps running (see `submit.py status`)")
            return 130


def _run_config(args: argparse.Namespace) -> JobConfig:
    overrides = list(args.overrides) + (["train.as_test=true"] if args.as_test else [])
    if args.size:
        overrides = preset_overrides(args.size, args.config, overrides) + overrides
    cfg = absolutize(load_config(args.config, overrides), Path.cwd())
    job_env(cfg, args.env)  # a bad --env is bad input, found before anything else
    return cfg


def _run(args: argparse.Namespace, cfg: JobConfig, target: cluster.Target) -> int:
    from trainer.preflight import run_all

    report = run_all(cfg, strict=target.local)
    for note in report.notes:
        log.info("preflight: %s", note)
    refusal = None if args.force else submit_refusal(cfg, args)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.resubmit:
        from tools.jobcli import resubmit

        step = resubmit.finished_step(cfg)
        if step is not None:
            print(f"run {cfg.run.name} already finished (step {step}); nothing to resubmit")
            return 0
        # One token for the whole wait: the environment may change under a long wait.
        token = target.token or (auth_headers() or {}).get("Authorization", "")[7:] or None

        def connect() -> Any:
            client = client_for(target.address, token)
            client.list_jobs()
            return client

        client = resubmit.wait_for_cluster(connect, target.address, args.wait)
        live = runs.live(runs.submissions(client.list_jobs(), cfg.run.name))
        if live is not None:
            print(f"run {cfg.run.name} is live as job {live.submission_id}; following it")
            return _follow_to_end(client, live.submission_id, progress=not args.no_progress)
        target = cluster.Target(target.address, token, target.source, target.local)
    client, job_id = submit(
        cfg, target.address, job_env(cfg, args.env), target.token, local=target.local
    )
    print(f"submitted job {job_id} to {target.address}", flush=True)
    if args.no_follow:
        return 0
    return _follow_to_end(client, job_id, progress=not args.no_progress)


def _follow_to_end(client: Any, job_id: str, progress: bool) -> int:
    status, summary = follow(client, job_id, progress=progress)
    if summary:
        print_marked(SUMMARY_MARK, summary)
    print(f"job {job_id}: {status}", flush=True)
    if status == "SUCCEEDED":
        return 0
    for line in failure_lines(client, job_id, status):
        print(line, file=sys.stderr)
    return 1


def _pick(client: Any, name: str, live_only: bool = False) -> Any:
    """A run's newest (or newest live) submission; a submission id works too."""
    jobs = client.list_jobs()
    exact = [j for j in jobs if j.submission_id == name]
    mine = exact or runs.submissions(jobs, name)
    if not mine:
        known = ", ".join(runs.by_run(jobs)) or "none"
        raise UserError(f"no run or submission named {name!r} on this cluster (runs: {known})")
    if live_only:
        job = runs.live(mine)
        if job is None:
            newest = mine[-1]
            raise UserError(
                f"{name}: nothing to stop; its newest submission {newest.submission_id} is "
                f"{runs.state(newest)}"
            )
        return job
    return mine[-1]


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _runs_table(client: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="runs")
    for col in ("run", "submission", "state", "started", "ended"):
        table.add_column(col)
    for name, jobs in runs.by_run(client.list_jobs()).items():
        for i, job in enumerate(reversed(jobs)):
            table.add_row(
                name if i == 0 else "",
                job.submission_id,
                runs.state(job),
                _when(job.start_time),
                _when(job.end_time),
            )
    Console(width=140).print(table)
    return 0


def _status(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    if not args.run:
        return _runs_table(client)
    job = _pick(client, args.run)
    meta = job.metadata or {}
    total = None
    if not meta.get("raylift_max_steps"):
        with contextlib.suppress(RuntimeError):
            total = runs.total_from_logs(client.get_job_logs(job.submission_id))
    p = runs.read_progress(meta, total)
    state = runs.state(job)
    step = "-" if p.step is None else f"{p.step}" + (f"/{p.total}" if p.total else "")
    lines = [
        ("run", meta.get(runs.RUN_KEY, args.run)),
        ("submission", job.submission_id),
        ("state", state),
        ("step", step),
        ("loss", "-" if p.loss is None else f"{p.loss:.4f}"),
        ("tokens/s", "-" if p.tokens_per_s is None else f"{p.tokens_per_s:.0f}"),
        ("eta", runs.duration(p.eta_s) if state in runs.LIVE else "-"),
        ("restarts", str(p.restarts)),
        ("lost steps", str(p.lost_steps)),
        ("memory", p.memory or "-"),
        ("slowest", p.slowest or "-"),
    ]
    if p.note:
        lines.append(("note", p.note))
    if job.message and state not in runs.LIVE:
        lines.append(("ray", job.message.strip().splitlines()[-1]))
    for key, value in lines:
        print(f"{key:>11}: {value}")
    return 1 if state in ("FAILED", "STOPPED") else 0


def _logs(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    job = _pick(client, args.run)
    if args.follow:
        return _follow_to_end(client, job.submission_id, progress=False)
    sys.stdout.write(client.get_job_logs(job.submission_id))
    sys.stdout.flush()
    return 0


def _stop(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    job = _pick(client, args.run, live_only=True)
    client.stop_job(job.submission_id)
    deadline = time.monotonic() + 60
    status = client.get_job_status(job.submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job.submission_id)
    print(f"job {job.submission_id}: {getattr(status, 'value', status)}", flush=True)
    return 0


def _list(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    return _runs_table(client)


def _doctor(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    from tools.jobcli import doctor

    shared, storage, endpoint, region = args.shared, args.storage, args.endpoint_override, None
    if args.config:
        cfg = absolutize(load_config(args.config), Path.cwd())
        storage = storage or cfg.storage.path
        endpoint = endpoint or cfg.storage.endpoint_override
        region = cfg.storage.region
    cmd = ["python", "-m", "trainer", "doctor"]
    if storage and storage.startswith("s3://"):
        cmd += ["--bucket", storage]
        if endpoint:
            cmd += ["--endpoint-override", endpoint]
        if region:
            cmd += ["--region", region]
    elif storage:
        shared = shared or storage
    if shared:
        cmd += ["--shared", shared]
    env = {"PYTHONUNBUFFERED": "1"}
    for item in args.env:
        key, eq, value = item.partition("=")
        env[key] = value if eq else os.environ.get(key, "")
    with tempfile.TemporaryDirectory(prefix="raylift-doctor-") as workdir:
        job_id = _submit_with_retry(
            client,
            entrypoint=" ".join(shlex.quote(c) for c in cmd),
            runtime_env=_runtime_env(workdir, env, target.local),
            submission_id=f"raylift-doctor-{int(time.time() * 1000)}",
            metadata={"raylift_doctor": "1"},
        )
    log.info("doctor: job %s checks every node …", job_id)
    status, _ = follow(client, job_id, progress=False, echo=False)
    result = doctor.parse(client.get_job_logs(job_id))
    if status != "SUCCEEDED" or result is None:
        for line in failure_lines(client, job_id, status):
            print(line, file=sys.stderr)
        return 1
    result["cluster"] = {
        "collective": result.pop("collective"),
        "jobs api auth": doctor.probe_auth(target.address),
    }
    doctor.judge(result)
    doctor.render(result)
    bad = doctor.failures(result)
    if bad:
        print(f"doctor: {len(bad)} check(s) failed", file=sys.stderr)
        return 1
    print("doctor: every check passed", flush=True)
    return 0


VERB_FUNCS = {
    "status": _status,
    "logs": _logs,
    "stop": _stop,
    "list": _list,
    "doctor": _doctor,
}


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
