"""PyTorch's CUDA allocator setting for GPU workers: expandable segments on by default.

With `expandable_segments:True` the caching allocator maps pages into one growing segment
per stream instead of caching fixed-size segments that never merge, which removes most of
the gap between reserved and allocated memory (trainer.planner.device's allocator slack
models both settings). It is set where the worker environment is made: Ray Train's
worker runtime_env (trainer.runtime.launch) and, under torchrun, this process's own
environment before CUDA starts. A PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF (torch's
newer name for it) the user set is passed on unchanged, never overridden;
`scaling.expandable_segments: false` sets nothing. When not to use it: docs/planning.md.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

from trainer.config import JobConfig

VAR = "PYTORCH_CUDA_ALLOC_CONF"
USER_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
SETTING = "expandable_segments:True"

log = logging.getLogger(__name__)


def allocator_env(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allocator variables a GPU worker gets: the user's own if set, else ours (when the
    switch is on); nothing for CPU jobs."""
    env = os.environ if environ is None else environ
    if not cfg.scaling.use_gpu:
        return {}
    own = {k: env[k] for k in USER_VARS if k in env}
    if own:
        return own
    return {VAR: SETTING} if cfg.scaling.expandable_segments else {}


def apply(cfg: JobConfig, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """This process is the worker (torchrun): set the variable before CUDA starts; if torch
    already started CUDA here, switch the running allocator too."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in allocator_env(cfg, env).items() if k not in env}
    env.update(added)
    torch = sys.modules.get("torch")
    if added and torch is not None and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(SETTING)
    if added:
        log.info("GPU allocator: %s", ", ".join(f"{k}={v}" for k, v in added.items()))
    return added
