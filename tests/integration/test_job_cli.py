"""`tools/submit.py`'s verbs against the real local Ray cluster on 127.0.0.1. One long job
carries the run's whole life (submit, duplicate refused, status, list, logs, stop), since
each job costs ~45 s; the no-token and failing-job paths are in test_ray_train.py."""

from __future__ import annotations

import contextlib
import os
import re
import time
from urllib.parse import urlparse

import psutil
import pytest

from tests.integration import stubs
from tools.jobcli import cluster, runs, submit
from tools.jobcli.client import client_for
from tools.jobcli.main import main

pytestmark = pytest.mark.slow


def test_run_lifecycle_through_the_verbs(ray_cluster, job, capsys):
    url = ray_cluster.dashboard_url
    path = job("cli", train={"max_steps": 5000, "eval_every": None})
    common = ["--address", url]
    assert main([str(path), "--no-follow", *common, "--env", "RAYLIFT_CLI_MARK=m1"]) == 0
    out = capsys.readouterr().out
    assert "submitted job raylift-cli-1 " in out, out
    client = client_for(url)
    info = client.get_job_info("raylift-cli-1")
    assert info.runtime_env["env_vars"]["RAYLIFT_CLI_MARK"] == "m1"

    # The same run again while it is live: refused with its status, nothing submitted.
    before = len(client.list_jobs())
    assert main(["run", str(path), "--no-follow", *common]) == 2
    err = capsys.readouterr().err
    assert "error: run cli is already " in err and "as job raylift-cli-1" in err, err
    assert len(client.list_jobs()) == before

    # Wait (bounded) for the first steps in the run's metrics file.
    meta = info.metadata
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        progress = runs.read_progress(meta)
        if progress.step and progress.step >= 2:
            break
        assert not client.get_job_status("raylift-cli-1").is_terminal(), client.get_job_logs(
            "raylift-cli-1"
        )[-3000:]
        time.sleep(0.5)
    assert progress.step and progress.step >= 2, "no training step in time"
    # The driver runs on the head (no CPUs there), with memory reserved for it there.
    head = ray_cluster._cluster.head_node.node_id
    assert client.get_job_info("raylift-cli-1").driver_node_id == head
    assert submit.driver_placement(url) == {
        "entrypoint_memory": submit.DRIVER_MEMORY,
        "entrypoint_label_selector": {"ray.io/node-id": head},
    }

    assert main(["status", "cli", *common]) == 0
    lines = dict(
        (k.strip(), v.strip())
        for k, _, v in (x.partition(":") for x in capsys.readouterr().out.splitlines())
    )
    assert lines["state"] == "RUNNING" and lines["submission"] == "raylift-cli-1"
    step, total = (int(x) for x in lines["step"].split("/"))
    assert step >= 2 and total == 5000
    assert float(lines["loss"]) > 0 and float(lines["tokens/s"]) > 0
    assert lines["eta"] != "-" and lines["restarts"] == "0" and lines["lost steps"] == "0"
    # The fullest rank and the slowest part of the step (trainer.observability.workerstats).
    memory = r"rank [01]: \d+\.\d\d GiB peak \(\d+% of \d+\.\d GiB\)"
    assert re.fullmatch(memory, lines["memory"]), lines["memory"]
    slowest = r" \d\.\d{3} s of \d\.\d{3} s per step \(\d+%\); slowest rank [01]$"
    assert re.search(slowest, lines["slowest"]), lines["slowest"]

    assert main(["list", *common]) == 0
    table = capsys.readouterr().out
    assert any("raylift-cli-1" in x and "RUNNING" in x and "cli" in x for x in table.splitlines())

    assert main(["logs", "cli", *common]) == 0
    assert "step 1/5000 loss" in capsys.readouterr().out

    assert main(["stop", "cli", *common]) == 0
    assert "job raylift-cli-1: STOPPED" in capsys.readouterr().out
    assert main(["status", "cli", *common]) == 1  # stopped: exit 1
    assert "STOPPED" in capsys.readouterr().out
    # Following a stopped submission exits 1 with Ray's message and the log's tail.
    assert main(["logs", "cli", "--follow", *common]) == 1
    err = capsys.readouterr().err
    assert "error: job raylift-cli-1 STOPPED" in err and "  | " in err
    assert main(["stop", "cli", *common]) == 2  # nothing live to stop
    assert "nothing to stop" in capsys.readouterr().err
    # Finished: the run may be submitted again (that is how it resumes), as the next id.
    assert runs.next_submission_id(runs.submissions(client.list_jobs(), "cli"), "cli") == (
        "raylift-cli-2"
    )


def test_stack_address_goes_through_an_ssm_port_forward_closed_at_exit(
    ray_cluster, tmp_path, monkeypatch, capsys
):
    """No --address, no RAY_ADDRESS, a `pulumi` on PATH: the tool reads the stack's outputs,
    finds the head instance, fetches the token from Secrets Manager, opens an SSM port
    forward on a free local port, talks through it, and closes it before returning."""
    stubs.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(tmp_path))
    monkeypatch.setenv("STUB_FORWARD_TO", str(urlparse(ray_cluster.dashboard_url).port))
    monkeypatch.setenv("STUB_RAY_TOKEN", ray_cluster.token)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)

    assert main(["list"]) == 0, capsys.readouterr().err
    assert "runs" in capsys.readouterr().out
    calls = stubs.calls(tmp_path)
    assert [c["tool"] for c in calls] == ["pulumi", "aws", "aws", "aws"]
    assert calls[0]["cwd"].endswith("/infra")
    describe, secret, ssm = (c["args"] for c in calls[1:])
    assert f"Name=tag:aws:autoscaling:groupName,Values={stubs.ASG}" in describe
    assert secret[secret.index("--secret-id") + 1] == stubs.SECRET_ARN
    assert ssm[ssm.index("--target") + 1] == stubs.HEAD_INSTANCE
    assert '"portNumber":["8265"]' in ssm[ssm.index("--parameters") + 1]
    pid = int((tmp_path / "ssm.pid").read_text())
    assert (tmp_path / "ssm.closed").exists()  # the forward was told to end, and did
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    # Through the tunnel the address is 127.0.0.1, but the cluster is not this machine:
    # strict (local-file) preflight and shipping this checkout's trainer stay off.
    with contextlib.ExitStack() as stack:
        target = cluster.resolve(None, stack)
        assert target.address.startswith("http://127.0.0.1:") and not target.local
        assert client_for(target.address, target.token).list_jobs() is not None

    # The token really is the one from Secrets Manager: a wrong one there is refused.
    monkeypatch.setenv("STUB_RAY_TOKEN", "0" * 64)
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert "refused the token" in err and "Traceback" not in err
