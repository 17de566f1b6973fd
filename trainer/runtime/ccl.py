"""oneCCL on Ray Train: a BackendConfig that prepares every worker before the process group.

Ray Train calls `init_process_group` itself, in its backend's `on_start`, before the
training function runs; `backend="ccl"` only exists once `oneccl_bindings_for_pytorch`
is imported, and oneCCL reads its transport settings (FI_PROVIDER, FI_TCP_IFACE,
CCL_WORKER_COUNT, ...) from the environment when it initialises. So this backend runs a
preparation step on every worker first (import the bindings, set the environment), then
hands over to Ray's own torch backend. The same code path runs with gloo substituted
where the bindings cannot be installed (torch 2.13 has none; the ccl image pins torch 2.8).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from ray.train.torch.config import TorchConfig, _TorchBackend

from trainer.errors import UserError

BINDINGS = "oneccl_bindings_for_pytorch"
CCL_IMAGE = "the ccl image (images/ccl: CPU torch + oneCCL bindings)"


def default_env() -> dict[str, str]:
    """oneCCL over TCP through libfabric, one progress thread per rank (what the ccl image
    documents for EC2 CPU nodes without EFA)."""
    return {
        "FI_PROVIDER": os.environ.get("FI_PROVIDER", "tcp"),
        "FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "eth0"),
        "CCL_WORKER_COUNT": os.environ.get("CCL_WORKER_COUNT", "1"),
        "CCL_PROCESS_LAUNCHER": "none",
        "CCL_ATL_TRANSPORT": os.environ.get("CCL_ATL_TRANSPORT", "ofi"),
    }


def prepare_worker(bindings: str | None, env: dict[str, str]) -> dict[str, str]:
    """Runs on each worker before init_process_group: environment first (oneCCL reads it
    when the bindings load), then the import that registers the backend."""
    for key, value in env.items():
        os.environ[key] = value
    # Ray sets LOCAL_RANK/LOCAL_WORLD_SIZE later; oneCCL without a launcher needs them now.
    os.environ.setdefault("CCL_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("CCL_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if bindings:
        try:
            importlib.import_module(bindings)
        except ImportError:
            raise UserError(
                f"scaling.backend ccl: {bindings} is not installed on this worker; run the "
                f"job in {CCL_IMAGE}, or use scaling.backend gloo"
            ) from None
    return {k: os.environ[k] for k in (*env, "CCL_LOCAL_RANK", "CCL_LOCAL_SIZE")}


@dataclass
class OneCCLConfig(TorchConfig):
    """TorchConfig whose backend prepares oneCCL on every worker first. `backend` stays
    "ccl" in production; tests substitute "gloo" to run the same path."""

    backend: str | None = "ccl"
    bindings: str | None = BINDINGS
    env: dict[str, str] = field(default_factory=default_env)

    @property
    def backend_cls(self) -> type:
        return _OneCCLBackend


class _OneCCLBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: OneCCLConfig) -> None:  # type: ignore[override]
        worker_group.execute(prepare_worker, backend_config.bindings, dict(backend_config.env))
        super().on_start(worker_group, backend_config)
