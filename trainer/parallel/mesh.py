"""The one device mesh of a run: named dims (dp, pp, tp), row-major, so the workers of a
model-parallel group are consecutive ranks (on one node when tp × pp fits in it: tensor
parallelism's per-layer collectives stay on the node's fast links)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


def build_mesh(layout: Layout, device: torch.device) -> Any:
    """A DeviceMesh over every rank with dims ("dp", "pp", "tp"); needs the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != layout.world:
        raise RuntimeError(
            f"{world} workers cannot form the mesh dp {layout.dp} × pp {layout.pp} × tp {layout.tp}"
        )
    return init_device_mesh(
        device.type,
        (layout.dp, layout.pp, layout.tp),
        mesh_dim_names=("dp", "pp", "tp"),
    )
