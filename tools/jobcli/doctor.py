"""`submit.py doctor`: submit `python -m trainer doctor`, then judge and show its answer.

The job reports each node's facts (trainer.runtime.doctor); this side decides what is red, since
only here are all nodes seen together: a version that differs across nodes is red on
every node, whichever one is "right". Token auth is also probed from here, the way an
attacker would: a request to the Jobs API without the token must be refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from tools.jobcli import cluster
from tools.jobcli.client import submit_with_retry
from tools.jobcli.follow import failure_lines, follow
from tools.jobcli.submit import absolutize, runtime_env
from trainer.config import load_config
from trainer.observability.logs import find_marked
from trainer.runtime.doctor import MARK

log = logging.getLogger("raylift.submit")

VERSIONED = ("python", "ray", "torch", "transformers")


def run(args: argparse.Namespace, client: Any, target: cluster.Target) -> int:
    """The `doctor` verb: one job checks every node; exit 1 when any check is red."""
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
        job_id = submit_with_retry(
            client,
            entrypoint=" ".join(shlex.quote(c) for c in cmd),
            runtime_env=runtime_env(workdir, env, target.local),
            submission_id=f"raylift-doctor-{int(time.time() * 1000)}",
            metadata={"raylift_doctor": "1"},
        )
    log.info("doctor: job %s checks every node …", job_id)
    status, _ = follow(client, job_id, progress=False, echo=False)
    result = parse(client.get_job_logs(job_id))
    if status != "SUCCEEDED" or result is None:
        for line in failure_lines(client, job_id, status):
            print(line, file=sys.stderr)
        return 1
    result["cluster"] = {
        "collective": result.pop("collective"),
        "jobs api auth": probe_auth(target.address),
    }
    judge(result)
    render(result)
    bad = failures(result)
    if bad:
        print(f"doctor: {len(bad)} check(s) failed", file=sys.stderr)
        return 1
    print("doctor: every check passed", flush=True)
    return 0


def parse(logs: str) -> dict[str, Any] | None:
    for line in reversed(logs.splitlines()):
        found, _ = find_marked(line, MARK)
        if found is not None:
            return found
    return None


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Mark versions that are not the same on every node as failed (in place)."""
    nodes = result["nodes"]
    for key in VERSIONED:
        values = Counter(n["checks"][key]["value"] for n in nodes if key in n["checks"])
        if len(values) > 1:
            for n in nodes:
                row = n["checks"].get(key)
                if row is not None:
                    others = sorted(v for v in values if v != row["value"])
                    row["ok"] = False
                    row["detail"] = f"differs across nodes (also {', '.join(others)})"
    return result


def failures(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(node, check) for every red row; node "cluster" for cluster-wide rows."""
    out = [
        (n["node_id"], name)
        for n in result["nodes"]
        for name, row in n["checks"].items()
        if not row["ok"]
    ]
    for name, row in result.get("cluster", {}).items():
        if not row["ok"]:
            out.append(("cluster", name))
    return out


def probe_auth(address: str) -> dict[str, Any]:
    """Without a token the Jobs API must say 401/403; a 200 means anyone can run code."""
    req = urllib.request.Request(address.rstrip("/") + "/api/jobs/")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            code = r.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except OSError as exc:
        return {"value": f"could not probe: {exc}", "ok": False}
    if code in (401, 403):
        return {"value": f"token required (a request without it got {code})", "ok": True}
    return {"value": f"OPEN: a request without a token got {code}", "ok": False}


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for n in result["nodes"]:
        role = "head" if n.get("head") else "worker"
        labels = ",".join(
            f"{k}={v}"
            for k, v in sorted(n.get("labels", {}).items())
            if not k.startswith("ray.io/")  # Ray's own (node id, market type, …)
        )
        title = f"node {n['node_id'][:12]} ({role}, {n.get('ip', '?')}) {labels}".rstrip()
        table = Table(title=title, title_justify="left")
        table.add_column("check")
        table.add_column("value")
        table.add_column("")
        for name, row in n["checks"].items():
            value = row["value"] + (f" — {row['detail']}" if row.get("detail") else "")
            mark = "ok" if row["ok"] else "FAIL"
            table.add_row(name, value, mark, style=None if row["ok"] else "bold red")
        console.print(table)
    table = Table(title="cluster", title_justify="left")
    table.add_column("check")
    table.add_column("value")
    table.add_column("")
    for name, row in result.get("cluster", {}).items():
        mark = "ok" if row["ok"] else "FAIL"
        table.add_row(name, row["value"], mark, style=None if row["ok"] else "bold red")
    console.print(table)
