"""`run`: from a job YAML to a submitted job.

The config is validated, preflighted and planned here, before anything runs on the
cluster; the exact resolved config that passed is what the job runs (uploaded as the
job's working_dir). A job the planner says will not fit is refused (exit 2) unless
`--force`; `--resubmit` brings a lost run back (tools/jobcli/resubmit.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools.jobcli import cluster, runs
from tools.jobcli.client import auth_headers, client_for, submit_with_retry
from tools.jobcli.follow import follow_to_end
from tools.jobcli.presets import preset_overrides
from trainer.config import JobConfig, load_config
from trainer.errors import UserError
from trainer.planner.report import submit_refusal
from trainer.storage import hub

log = logging.getLogger("raylift.submit")
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
        if hub.parse(value, dataset=False) if value else False:  # org/name: a Hub id
            return value
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
    for reward in data["train"]["rl"]["rewards"]:  # path/to/file.py:name (never a Hub id)
        file, sep, name = reward["function"].rpartition(":")
        if sep and file.endswith(".py") and not Path(file).is_absolute():
            reward["function"] = f"{(base / file).resolve()}:{name}"
    return JobConfig.model_validate(data)


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


def runtime_env(workdir: str, env: dict[str, str], local: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"working_dir": workdir, "env_vars": env}
    if local:
        # A local cluster runs this checkout's trainer; a remote one runs its image's.
        import trainer

        spec["py_modules"] = [str(Path(trainer.__file__).resolve().parent)]
        spec["excludes"] = ["__pycache__", "*.pyc"]
    return spec


def submit(
    cfg: JobConfig,
    address: str,
    env_vars: dict[str, str] | None = None,
    token: str | None = None,
    local: bool | None = None,
) -> tuple[Any, str]:
    """Submit `python -m trainer run` for this config. Refused (RunIsLive) while another
    submission of the same run is PENDING or RUNNING; the id is `raylift-<run>-<n>`."""
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
                    f"{busy.submission_id}; follow it with `raylift logs {cfg.run.name} "
                    f"--follow`, or stop it with `raylift stop {cfg.run.name}`"
                )
            try:
                job_id = submit_with_retry(
                    client,
                    entrypoint="python -m trainer run job.yaml",
                    runtime_env=runtime_env(
                        workdir, env, cluster.is_loopback(address) if local is None else local
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


def run_config(args: argparse.Namespace) -> JobConfig:
    overrides = list(args.overrides) + (["train.as_test=true"] if args.as_test else [])
    if args.size:
        overrides = preset_overrides(args.size, args.config, overrides) + overrides
    cfg = absolutize(load_config(args.config, overrides), Path.cwd())
    job_env(cfg, args.env)  # a bad --env is bad input, found before anything else
    return cfg


def run(args: argparse.Namespace, cfg: JobConfig, target: cluster.Target) -> int:
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
            return follow_to_end(client, live.submission_id, progress=not args.no_progress)
        target = cluster.Target(target.address, token, target.source, target.local)
    client, job_id = submit(
        cfg, target.address, job_env(cfg, args.env), target.token, local=target.local
    )
    print(f"submitted job {job_id} to {target.address}", flush=True)
    if args.no_follow:
        return 0
    return follow_to_end(client, job_id, progress=not args.no_progress)
