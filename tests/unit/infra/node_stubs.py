"""Run a node's bootstrap or start script with stub commands in place of the machine's.

Every command that would touch AWS, Docker, the kernel or the network (aws, docker, curl, mount,
systemctl, shutdown, ...) is a stub on PATH that records its arguments and answers as a healthy
node would, unless the test says otherwise. The script's own paths are redirected under a
scratch root through RAYLIFT_ROOT, so nothing outside tmp_path is written and nothing but the
stubs is called.

Each call is appended under an exclusive `flock`, as one record: the stubs of a pipeline
(`aws ecr get-login-password | docker login`) run at the same time, and unlocked appends from
two processes can interleave into one garbled record.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.components.userdata import NodeBootstrap
from infra.settings import RaySettings

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/raylift/trainer:trainer-gpu-0.1.0-abcdef0"


def node(role: str, **overrides: Any) -> NodeBootstrap:
    """A head or a gpu-spot worker of a cluster named demo, as the program would describe it."""
    base = dict(
        role=role,
        pool="head" if role == "head" else "gpu-spot",
        market="on-demand" if role == "head" else "spot",
        cluster_name="demo",
        region="us-east-1",
        efs_id="fs-0123456789abcdef0",
        mount_path="/mnt/shared",
        image=IMAGE,
        head_fqdn="head.demo.raylift.internal",
        ray=RaySettings(),
        use_gpus=role != "head",
        labels={"pool": "gpu-spot", "market": "spot"} if role != "head" else {"pool": "head"},
        resources={} if role == "head" else {"large_cpu_mem": 1},
        num_cpus=0 if role == "head" else None,
        token_secret_arn="arn:aws:secretsmanager:us-east-1:123456789012:secret:demo-AbCdEf",
        hosted_zone_id="Z0123456789" if role == "head" else None,
        lifecycle_hook=None if role == "head" else "raylift-drain",
    )
    base.update(overrides)
    return NodeBootstrap(**base)


# What a healthy node's commands answer. $STATE is a scratch folder for stub state.
DEFAULT_BEHAVIOUR: dict[str, str] = {
    "curl": """case "$*" in
  *api/token*) echo imds-token ;;
  *meta-data/instance-id*) echo i-0abc123 ;;
  *meta-data/instance-type*) echo g5.12xlarge ;;
  *meta-data/local-ipv4*) echo 10.42.0.7 ;;
  *groupName*) echo demo-gpu-spot-20251122 ;;
  *) exit 22 ;;
esac""",
    "aws": """case "$1 $2" in
  "secretsmanager get-secret-value") echo the-token ;;
  "ecr get-login-password") echo password ;;
esac""",
    # `docker login --password-stdin` reads its stdin (else the writer of the pipe gets
    # SIGPIPE); the image is not on the machine yet: `docker image inspect` fails.
    "docker": """if [ "$1" = login ]; then cat >/dev/null; fi
[ "$1 $2" != "image inspect" ]""",
    "mountpoint": """[ -e "$STATE/mounted" ]""",
    # `mount -o OPTS DEVICE PATH` (the local NVMe) also shows in the node's /proc/mounts.
    "mount": """touch "$STATE/mounted"
if [ "$1" = -o ]; then
  mkdir -p "$RAYLIFT_ROOT/proc" && echo "$3 $4 xfs rw,$2 0 0" >>"$RAYLIFT_ROOT/proc/mounts"
fi""",
    "mkfs.xfs": "true",
    "mdadm": "true",
    # No file system on a fresh instance-store device.
    "blkid": "exit 2",
    "mount.nfs4": "true",
    "chown": "true",
    "systemctl": "true",
    "apt-get": "true",
    "shutdown": "true",
    "sleep": "true",
}


def fail_first(tool: str, n: int, when: str = "true") -> dict[str, str]:
    """A behaviour where `tool` fails its first `n` calls matching the shell test `when`, and
    otherwise answers as by default (n large = always fails)."""
    return {
        tool: f"""if {when}; then
  count=$(cat "$STATE/count.{tool}" 2>/dev/null || echo 0)
  echo $((count + 1)) >"$STATE/count.{tool}"
  if [ "$count" -lt {n} ]; then exit 1; fi
fi
{DEFAULT_BEHAVIOUR[tool]}"""
    }


@dataclass
class ScriptRun:
    proc: subprocess.CompletedProcess[str]
    calls: list[list[str]]
    root: Path

    def docker_runs(self) -> list[list[str]]:
        return [c for c in self.calls if c[:2] == ["docker", "run"]]

    def called(self, *prefix: str) -> list[list[str]]:
        return [c for c in self.calls if c[: len(prefix)] == list(prefix)]


def _write_stubs(bin_dir: Path, log: Path, behaviour: dict[str, str | None]) -> None:
    bin_dir.mkdir()
    for tool, body in {**DEFAULT_BEHAVIOUR, **behaviour}.items():
        if body is None:  # the command is not installed
            continue
        stub = bin_dir / tool
        stub.write_text(
            "#!/bin/bash\n"
            f'{{ flock 9; printf "%s\\0" {tool} "$@" >>"{log}"; printf "\\n" >>"{log}"; }}'
            f' 9>>"{log}.lock"\n'
            f"{body}\n"
        )
        stub.chmod(0o755)


def run_script(
    script: str,
    tmp_path: Path,
    *,
    mounted: bool = False,
    behaviour: dict[str, str | None] | None = None,
) -> ScriptRun:
    """Run `script` under bash with the stubs; `mounted` starts with EFS already mounted."""
    # Never run a script that would write to this machine's /etc, /usr/local or /var.
    assert 'R="${RAYLIFT_ROOT:-}"' in script, "script does not honour RAYLIFT_ROOT"
    bin_dir, log, state, root = (tmp_path / n for n in ("bin", "calls.log", "state", "root"))
    _write_stubs(bin_dir, log, behaviour or {})
    state.mkdir()
    root.mkdir(exist_ok=True)
    if mounted:
        (state / "mounted").touch()
    path = tmp_path / "script.sh"
    path.write_text(script)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STATE": str(state),
        "RAYLIFT_ROOT": str(root),
    }
    proc = subprocess.run(
        ["bash", str(path)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    calls = [
        [arg for arg in line.split("\0") if arg]
        for line in (log.read_text().split("\n") if log.exists() else [])
        if line.strip("\0")
    ]
    return ScriptRun(proc=proc, calls=calls, root=root)


def inner_start_script(user_data: str) -> str:
    """The Ray start script the bootstrap writes (heredoc RAYLIFT_RAY)."""
    match = re.search(r"<<'RAYLIFT_RAY'\n(.*?)\nRAYLIFT_RAY\n", user_data, flags=re.S)
    assert match, "start script heredoc not found"
    return match.group(1)
