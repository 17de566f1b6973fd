"""What a DeepSpeed NVMe offload needs of the worker nodes, checked on each of them before
any worker starts: the `nvme_path` exists and is writable there, and DeepSpeed's async
I/O op can run (it needs libaio; the trainer images carry it and the op prebuilt). The Ray
template's 70B file offloads the optimizer to `/mnt/local_storage/zero`; on a node
without that folder, or without libaio, DeepSpeed fails only once every worker has
loaded its share of the model. Here it fails in one line at submission.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

from trainer.errors import ConfigError


def local_problem(paths: dict[str, str]) -> str | None:
    """Why NVMe offload to `paths` ({json key: folder}) cannot run on this node; None if it
    can. Paths first (the common mistake), then the op."""
    for key, path in paths.items():
        _make_under_local_storage(path)
        if not os.path.isdir(path):
            return (
                f"{key} {path} does not exist; create it on every worker node (a local NVMe "
                "mount), or set the offload device to cpu"
            )
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".raylift-probe-"):
                pass
        except OSError as exc:
            return (
                f"{key} {path} is not writable ({exc.strerror}); make it writable by the "
                "worker's user, or set the offload device to cpu"
            )
    if not async_io_available():
        return (
            "DeepSpeed's async_io op cannot run here (libaio is missing, or the op is neither "
            "prebuilt nor buildable); set the offload device to cpu, or use the trainer "
            "images (libaio and the op prebuilt) or an image with libaio-dev and a compiler"
        )
    return None


def _make_under_local_storage(path: str) -> None:
    """A folder under this node's instance-store NVMe mount (RAYLIFT_LOCAL_STORAGE, which
    every fresh instance gets empty) is made here, so the template's `nvme_path:
    /mnt/local_storage/zero` runs unchanged on a Raylift node. Anywhere else a missing
    folder stays the user's mistake to fix."""
    from trainer.storage.local import local_storage

    root = local_storage()
    if root is None or os.path.isdir(path):
        return
    real = os.path.realpath(path)
    if os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root):
        try:
            os.makedirs(real, exist_ok=True)
        except OSError:
            return  # reported below as missing or not writable


def async_io_available() -> bool:
    """Whether DeepSpeed's NVMe op can run here. Prebuilt into the installed DeepSpeed (the
    trainer images, which have no compiler): it must load (libaio's library present).
    Otherwise DeepSpeed's own probe for a JIT build: libaio's headers and library, linked
    by a compiler."""
    import torch

    from trainer.strategies.deepspeed.engine import prepare_environment

    prepare_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if builder is None:
        return False
    if installed_ops.get(builder.name):
        try:
            builder.load(verbose=False)
        except (ImportError, OSError, RuntimeError):
            return False
        return True
    return bool(builder.is_compatible(verbose=False))


def check_ray_nodes(paths: dict[str, str], source: str, use_gpu: bool) -> None:
    """Run `local_problem` on every alive node that can host a worker (one with GPUs when
    the job uses them); raise ConfigError naming the first node and the problem."""
    if not paths:
        return
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_probe)
    want = "GPU" if use_gpu else "CPU"
    refs = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(paths)
        for node in ray.nodes()
        if node.get("Alive") and (node.get("Resources") or {}).get(want, 0) > 0
    ]
    for host, problem in ray.get(refs):
        if problem:
            raise ConfigError(f"{source}: on node {host}: {problem}")


def check_here(paths: dict[str, str], source: str) -> None:
    """The torchrun form: every process runs the preflight on its own node."""
    problem = local_problem(paths) if paths else None
    if problem:
        raise ConfigError(f"{source}: on node {socket.gethostname()}: {problem}")


def _probe(paths: dict[str, str]) -> tuple[Any, str | None]:
    import ray

    return ray.util.get_node_ip_address(), local_problem(paths)
