"""`raylift eval RUN` as a Ray job: `python -m trainer eval RUN --tasks ...` submitted to
the cluster `raylift run` would use (tools.jobcli.cluster), followed to its end. The job
scores the run's checkpoints where they are (trainer.evaluation.offline) and writes the
table and plot into RUN/eval/; its log, which this prints as it comes, ends with the table.

Task YAMLs given as paths are passed as absolute paths: a local cluster reads them here; a
remote cluster needs them at the same path on its head (or lm-eval task names)."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
import uuid
from pathlib import Path

from tools.jobcli import cluster
from tools.jobcli.client import client_for, submit_with_retry
from tools.jobcli.follow import follow_to_end
from tools.jobcli.submit import job_env, runtime_env
from trainer.errors import UserError

EVAL_KEY = "raylift_eval"
"""The job's metadata key naming the run it scores (not `raylift_run`: an eval job is not
a submission of the run, and must not count as one live)."""


def is_run(target: str) -> bool:
    """A run folder (its job.json), local or on S3, rather than an export folder."""
    return target.startswith("s3://") or (Path(target) / "job.json").is_file()


def cluster_target(address: str | None, stack: contextlib.ExitStack) -> cluster.Target | None:
    """The cluster to submit to; None when none is found and none was named (the local
    scoring then runs, as before)."""
    try:
        return cluster.resolve(address, stack)
    except UserError:
        if address:
            raise
        return None


def entrypoint(run: str, args: argparse.Namespace, endpoint: str | None, region: str | None) -> str:
    """The job's command line; a local run folder and task YAMLs become absolute paths."""
    words = ["python", "-m", "trainer", "eval", run, "--tasks"]
    words += [str(Path(t).resolve()) if t.endswith((".yaml", ".yml")) else t for t in args.tasks]
    if args.steps:
        words += ["--steps", *map(str, args.steps)]
    if args.limit is not None:
        words += ["--limit", str(args.limit)]
    words += ["--batch-size", str(args.batch_size)]
    if endpoint:
        words += ["--endpoint-override", endpoint]
    if region:
        words += ["--region", region]
    return shlex.join(words)


def submit_eval(args: argparse.Namespace, target: cluster.Target) -> int:
    """Submit the eval job for the run `args.target`, follow it, return 0 if it succeeded."""
    from trainer.evaluation.offline import run_config
    from trainer.storage.location import resolve

    run = args.target if args.target.startswith("s3://") else str(Path(args.target).resolve())
    cfg = run_config(resolve(run, args.endpoint_override, args.region))
    endpoint = args.endpoint_override or cfg.storage.endpoint_override
    region = args.region or cfg.storage.region
    env = job_env(cfg)
    client = client_for(target.address, target.token)
    job_id = f"raylift-eval-{cfg.run.name}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="raylift-eval-") as workdir:
        submit_with_retry(
            client,
            entrypoint=entrypoint(run, args, endpoint, region),
            runtime_env=runtime_env(workdir, env, target.local),
            submission_id=job_id,
            metadata={EVAL_KEY: cfg.run.name},
        )
    print(f"submitted job {job_id} to {target.address}", flush=True)
    return follow_to_end(client, job_id, progress=False)
