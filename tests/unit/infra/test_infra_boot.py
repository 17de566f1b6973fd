"""The whole node bootstrap under stubs: each boot step's failure and what the node does about it.

A step that fails for a while (DNS of a new mount target, IAM propagation) is retried; a step
that keeps failing hands the node back to its Auto Scaling group (marked unhealthy, then shut
down, which the launch template turns into a termination), so the group replaces it instead of
keeping a node that EC2 calls healthy while no Ray runs on it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from node_stubs import IMAGE, ScriptRun, fail_first, node, run_script

from infra.components.userdata import BOOT_ATTEMPTS, CONTAINER_UID, render_user_data

TOKEN_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:demo-AbCdEf"


def boot(role: str, tmp_path: Path, behaviour: dict[str, str | None] | None = None) -> ScriptRun:
    return run_script(render_user_data(node(role)), tmp_path, behaviour=behaviour)


def assert_started(run: ScriptRun) -> None:
    assert run.proc.returncode == 0, run.proc.stdout + run.proc.stderr
    assert ["systemctl", "enable", "--now", "raylift-ray.service"] in run.calls
    assert not run.called("shutdown")
    assert not run.called("aws", "autoscaling", "set-instance-health")


def assert_replaced(run: ScriptRun, reason: str) -> None:
    assert run.proc.returncode != 0
    assert reason in run.proc.stdout, run.proc.stdout
    assert [
        "aws",
        "autoscaling",
        "set-instance-health",
        "--region",
        "us-east-1",
        "--instance-id",
        "i-0abc123",
        "--health-status",
        "Unhealthy",
        "--no-should-respect-grace-period",
    ] in run.calls
    assert run.called("shutdown", "-h", "now")
    assert not run.called("systemctl", "enable"), "Ray must not be started on a failed boot"


def test_worker_boots(tmp_path: Path) -> None:
    run = boot("worker", tmp_path)
    assert_started(run)
    fstab = (run.root / "etc" / "fstab").read_text()
    assert fstab.startswith("fs-0123456789abcdef0.efs.us-east-1.amazonaws.com:/ /mnt/shared nfs4 ")
    assert ["mount", "/mnt/shared"] in run.calls
    # The image's user owns the shared root (EFS creates it root-owned, mode 0755).
    uid = f"{CONTAINER_UID}:{CONTAINER_UID}"
    assert ["chown", uid, f"{run.root}/mnt/shared"] in run.calls
    assert ["docker", "pull", "--quiet", IMAGE] in run.calls
    token = run.root / "etc" / "raylift" / "ray-auth-token"
    assert token.read_text().strip() == "the-token"
    assert token.stat().st_mode & 0o777 == 0o444
    assert not run.called("aws", "route53"), "only the head publishes the head's name"
    assert not run.called("apt-get"), "nfs-common is already there"


def test_node_env_is_the_agent_contract(tmp_path: Path) -> None:
    run = boot("worker", tmp_path)
    env = dict(
        line.split("=", 1)
        for line in (run.root / "etc" / "raylift" / "node.env").read_text().splitlines()
    )
    assert env == {
        "RAYLIFT_CLUSTER": "demo",
        "RAYLIFT_ROLE": "worker",
        "RAYLIFT_POOL": "gpu-spot",
        "RAYLIFT_MARKET": "spot",
        "RAYLIFT_REGION": "us-east-1",
        "RAYLIFT_INSTANCE_ID": "i-0abc123",
        "RAYLIFT_ASG_NAME": "demo-gpu-spot-20251122",
        "RAYLIFT_INSTANCE_TYPE": "g5.12xlarge",
        "RAYLIFT_LIFECYCLE_HOOK": "raylift-drain",
        "RAYLIFT_SHARED_DIR": "/mnt/shared",
        "RAYLIFT_IMDS_ENDPOINT": "http://169.254.169.254",
        "RAYLIFT_AGENT_INTERVAL_S": "5",
        "RAYLIFT_AGENT_MARGIN_S": "15",
        # Ray's autoscaler v2 matches the node to its instance and its pool's node type.
        "RAY_CLOUD_INSTANCE_ID": "i-0abc123",
        "RAY_NODE_TYPE_NAME": "gpu-spot",
    }
    for folder in ("ray", "cache"):
        path = f"{run.root}/var/lib/raylift/{folder}"
        assert ["chown", f"{CONTAINER_UID}:{CONTAINER_UID}", path] in run.calls


@pytest.mark.parametrize(("role", "agent"), [("worker", True), ("head", False)])
def test_the_image_starts_the_node_agent_from_node_env(tmp_path: Path, role: str, agent: bool):
    """The contract end to end: the node.env a booted node wrote, given to the image's real
    entrypoint as the container's environment (`--env-file`), starts the agent on a worker
    with the metadata endpoint and margin infra chose, and Ray with the instance id."""
    run = boot(role, tmp_path)
    node_env = dict(
        line.split("=", 1)
        for line in (run.root / "etc" / "raylift" / "node.env").read_text().splitlines()
    )
    raylift_ray = (run.root / "usr" / "local" / "bin" / "raylift-ray").read_text()
    assert '--env-file "$R/etc/raylift/node.env"' in raylift_ray
    assert "ray start --block" in raylift_ray
    stubs = tmp_path / "image-bin"
    stubs.mkdir()
    for name in ("python", "ray"):
        (stubs / name).write_text(
            f'#!/usr/bin/env bash\necho "{name} $* instance=${{RAY_CLOUD_INSTANCE_ID:-}}"\n'
        )
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", **node_env}
    entrypoint = Path(__file__).resolve().parents[3] / "images" / "base" / "entrypoint.sh"
    result = subprocess.run(
        ["bash", str(entrypoint), "ray", "start", "--block"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    started = [line for line in lines if line.startswith("python -m trainer agent")]
    if agent:
        assert started == [
            "python -m trainer agent --imds-endpoint http://169.254.169.254 --interval 5 "
            "--margin 15 instance=i-0abc123"
        ]
        assert "ray start --block instance=i-0abc123" in lines
    else:
        assert started == []


def test_head_boots_and_publishes_its_name(tmp_path: Path) -> None:
    run = boot("head", tmp_path)
    assert_started(run)
    (call,) = run.called("aws", "route53", "change-resource-record-sets")
    batch = call[call.index("--change-batch") + 1]
    assert '"Name":"head.demo.raylift.internal"' in batch
    assert '"Value":"10.42.0.7"' in batch


def test_installs_nfs_with_a_dpkg_lock_timeout(tmp_path: Path) -> None:
    """Without mount.nfs4 the bootstrap installs nfs-common, waiting for the dpkg lock that
    unattended-upgrades holds on a fresh instance instead of failing on it."""
    run = boot("worker", tmp_path, {"mount.nfs4": None})
    assert_started(run)
    apt = run.called("apt-get")
    assert [c[c.index("-q") + 1 :] for c in apt] == [["update"], ["install", "-y", "nfs-common"]]
    assert all("DPkg::Lock::Timeout=600" in c for c in apt)


@pytest.mark.parametrize(
    ("role", "behaviour", "reason", "attempts_of"),
    [
        # A mount target whose DNS name never resolves.
        ("worker", {"mount": "exit 32"}, "mount EFS fs-0123456789abcdef0", ["mount"]),
        # The secret (or the role's permission to read it) never appears.
        (
            "worker",
            fail_first("aws", 10**6, '[ "$1" = secretsmanager ]'),
            "fetch the Ray auth token",
            ["aws", "secretsmanager"],
        ),
        # The head cannot publish its name (no route to Route53, no permission).
        (
            "head",
            fail_first("aws", 10**6, '[ "$1" = route53 ]'),
            "publish head.demo.raylift.internal",
            ["aws", "route53"],
        ),
        # The image cannot be pulled.
        ("worker", fail_first("docker", 10**6, '[ "$1" = pull ]'), "pull", ["docker", "pull"]),
    ],
    ids=["efs", "token", "head-dns", "image"],
)
def test_a_step_that_keeps_failing_hands_the_node_back(
    tmp_path: Path,
    role: str,
    behaviour: dict[str, str | None],
    reason: str,
    attempts_of: list[str],
) -> None:
    run = boot(role, tmp_path, behaviour)
    assert_replaced(run, f"FAILED: {reason}")
    assert len(run.called(*attempts_of)) == BOOT_ATTEMPTS  # bounded, not forever
    assert len(run.called("sleep")) == BOOT_ATTEMPTS - 1


def test_a_step_that_fails_for_a_while_is_retried(tmp_path: Path) -> None:
    run = boot("worker", tmp_path, fail_first("aws", 2, '[ "$1" = secretsmanager ]'))
    assert_started(run)
    assert len(run.called("aws", "secretsmanager")) == 3
    assert "fetch the Ray auth token failed (attempt 2/" in run.proc.stdout


def test_an_unretried_failure_also_hands_the_node_back(tmp_path: Path) -> None:
    run = boot("worker", tmp_path, {"systemctl": '[ "$1" != daemon-reload ]'})
    assert_replaced(run, "FAILED: bootstrap exited with status 1")


def test_a_node_that_cannot_reach_the_api_still_goes_away(tmp_path: Path) -> None:
    """No credentials or no route: the unhealthy mark fails, the shutdown still happens."""
    run = boot("worker", tmp_path, {"mount": "exit 32", "aws": "exit 255"})
    assert run.proc.returncode != 0
    assert run.called("aws", "autoscaling", "set-instance-health")
    assert run.called("shutdown", "-h", "now")


def test_token_auth_off_fetches_no_secret(tmp_path: Path) -> None:
    run = run_script(render_user_data(node("worker", token_secret_arn=None)), tmp_path)
    assert_started(run)
    assert not run.called("aws", "secretsmanager")
