"""Helpers shared by integration tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def torchrun_command(args: list[str], nproc: int = 2) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `torchrun` on one node, rendezvous and gloo on
    loopback only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        *args,
    ]
    return cmd, env


def torchrun(args: list[str], nproc: int = 2, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd, env = torchrun_command(args, nproc)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
