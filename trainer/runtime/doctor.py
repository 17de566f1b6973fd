"""`python -m trainer doctor`: check every alive node before a run finds the problem.

Runs as a Ray job's entrypoint (tools/submit.py doctor submits it). One zero-CPU actor is
pinned to each alive node and reports what that node would give a training worker:
versions, devices, free memory, the shared folder, the bucket and token auth. Then the
same actors join a gloo group and all-reduces a known tensor, so a firewall or a
wrong interface between nodes shows up here instead of at the first collective of a run.
The result is one `RAYLIFT_DOCTOR {json}` line; the client renders and judges it.
"""

from __future__ import annotations

import os
import platform
import socket
import uuid
from typing import Any

from trainer.observability.logs import print_marked

MARK = "RAYLIFT_DOCTOR "
COLLECTIVE_TIMEOUT_S = 60


def _row(value: Any, ok: bool = True, detail: str | None = None) -> dict[str, Any]:
    return {"value": str(value), "ok": bool(ok), **({"detail": detail} if detail else {})}


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _versions() -> dict[str, dict[str, Any]]:
    from importlib.metadata import PackageNotFoundError, version

    rows = {"python": _row(platform.python_version())}
    for name in ("ray", "torch", "transformers"):
        try:
            rows[name] = _row(version(name))  # the installed one, without importing it
        except PackageNotFoundError:
            rows[name] = _row("not installed", False)
    return rows


def _devices() -> dict[str, dict[str, Any]]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = {"cuda devices": _row(count)}
    if count:
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(count))
        rows["gpu memory free (min)"] = _row(f"{free / 2**30:.1f} GiB")
        try:
            from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

            found = getattr(lib, "compiled_with_cuda", False) and not isinstance(
                lib, ErrorHandlerMockBNBNativeLibrary
            )
            rows["bitsandbytes cuda"] = _row("found" if found else "not found", found)
        except Exception as exc:
            rows["bitsandbytes cuda"] = _row(f"import failed: {_short(exc)}", False)
    return rows


def _host_memory() -> dict[str, dict[str, Any]]:
    import psutil

    vm = psutil.virtual_memory()
    return {"host memory free": _row(f"{vm.available / 2**30:.1f} of {vm.total / 2**30:.1f} GiB")}


def _mount_of(path: str) -> str:
    import psutil

    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint.rstrip("/") or "/"
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) > len(best[0])
        ):
            best = (mp, part.fstype)
    return f"{best[0]} ({best[1]})" if best else "?"


def _shared(path: str) -> dict[str, Any]:
    """The folder exists here and this node can write, read back and delete in it."""
    if not os.path.isdir(path):
        return _row(f"{path}: missing (not mounted?)", False)
    probe = os.path.join(path, f".raylift-doctor-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        with open(probe) as f:
            if f.read() != "ok":
                return _row(f"{path}: read back differs", False)
        os.remove(probe)
    except OSError as exc:
        return _row(f"{path}: not writable: {_short(exc)}", False)
    return _row(f"{path} on {_mount_of(path)}: writable")


def _local_storage() -> dict[str, Any]:
    """The instance-store NVMe the boot mounted (RAYLIFT_LOCAL_STORAGE): writable, and how
    big; missing where the catalog says this instance type has one."""
    import shutil

    from trainer.planner.catalog import load_instances
    from trainer.storage.local import ENV, local_storage

    kind = os.environ.get("RAYLIFT_INSTANCE_TYPE", "")
    listed = load_instances().get(kind)
    expected = listed.nvme_gb if listed else 0
    path = local_storage()
    if path is None:
        if expected:
            return _row(
                f"not mounted: a {kind} has {expected:,.0f} GB of instance-store NVMe "
                f"({os.environ.get(ENV) or '/mnt/local_storage'} missing; see the node's "
                "/var/log/raylift-bootstrap.log)",
                False,
            )
        return _row("none on this node (scratch goes to the temp folder)")
    row = _shared(str(path))
    if row["ok"]:
        total = shutil.disk_usage(path).total / 1e9
        row["value"] += f", {total:,.0f} GB"
    return row


def _bucket(uri: str, endpoint: str | None, region: str | None) -> dict[str, Any]:
    from trainer.storage.location import resolve

    loc = resolve(uri, endpoint, region)
    probe = loc.join(f".raylift-doctor-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    step = "write"
    try:
        loc.fs.create_dir(loc.path, recursive=True)
        with loc.fs.open_output_stream(probe.path) as f:
            f.write(b"ok")
        step = "read"
        with loc.fs.open_input_stream(probe.path) as f:
            if f.read() != b"ok":
                return _row(f"{uri}: read back differs", False)
        step = "delete"
        loc.fs.delete_file(probe.path)
    except OSError as exc:
        return _row(f"{uri}: {step} failed: {_short(exc)}", False)
    return _row(f"{uri}: write/read/delete ok")


def _auth() -> dict[str, Any]:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        on = is_token_auth_enabled()
    except Exception:
        on = os.environ.get("RAY_AUTH_MODE") == "token"
    return _row("token" if on else "off (anyone who reaches the Jobs API runs code)", on)


def node_report(options: dict[str, Any]) -> dict[str, Any]:
    """Everything one node can tell about itself; runs as a task pinned to that node."""
    checks: dict[str, dict[str, Any]] = {}
    for part in (_versions, _devices, _host_memory):
        try:
            checks.update(part())
        except Exception as exc:
            checks[part.__name__.strip("_")] = _row(f"failed: {_short(exc)}", False)
    if options.get("shared"):
        checks["shared folder"] = _shared(options["shared"])
    if options.get("bucket"):
        checks["bucket"] = _bucket(
            options["bucket"], options.get("endpoint"), options.get("region")
        )
    checks["local nvme"] = _local_storage()
    checks["ray auth"] = _auth()
    return {"hostname": socket.gethostname(), "checks": checks}


class _Member:
    """One per node, pinned there: reports the node, then joins the gloo group and
    all-reduces its rank + 1 (one process per node does both, to start fewer)."""

    def report(self, options: dict[str, Any]) -> dict[str, Any]:
        return node_report(options)

    def address(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def all_reduce(self, rank: int, world: int, master: str, port: int) -> float:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            return float(t.item())
        finally:
            dist.destroy_process_group()


def _collective(ray: Any, actors: list[Any]) -> dict[str, Any]:
    world = len(actors)
    want = world * (world + 1) / 2
    try:
        master, port = ray.get(actors[0].address.remote(), timeout=120)
        sums = ray.get(
            [a.all_reduce.remote(r, world, master, port) for r, a in enumerate(actors)],
            timeout=COLLECTIVE_TIMEOUT_S + 120,
        )
    except Exception as exc:
        return _row(f"gloo all-reduce over {world} nodes failed: {_short(exc)}", False)
    ok = all(s == want for s in sums)
    return _row(f"gloo all-reduce over {world} nodes: sum {sums[0]:g} (want {want:g})", ok)


def alive_nodes() -> list[dict[str, Any]]:
    from ray.util.state import list_nodes

    out = []
    for n in list_nodes(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False):
        out.append(
            {
                "node_id": n.node_id,
                "ip": n.node_ip,
                "head": bool(n.is_head_node),
                "labels": dict(n.labels or {}),
            }
        )
    return sorted(out, key=lambda n: (not n["head"], n["node_id"]))


def run(options: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    nodes = alive_nodes()
    member = ray.remote(num_cpus=0, max_restarts=0)(_Member)
    actors = [
        member.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False)
        ).remote()
        for n in nodes
    ]
    refs = [a.report.remote(options) for a in actors]
    for node, ref in zip(nodes, refs, strict=True):
        try:
            node.update(ray.get(ref, timeout=300))
        except Exception as exc:
            node["checks"] = {"reachable": _row(f"no answer: {_short(exc)}", False)}
    try:
        collective = _collective(ray, actors) if actors else _row("no alive nodes", False)
    finally:
        for a in actors:
            ray.kill(a)
    return {"nodes": nodes, "collective": collective}


def main(options: dict[str, Any]) -> int:
    result = run(options)
    print_marked(MARK, result)
    return 0
