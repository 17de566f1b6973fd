"""What a GPU holds beyond the tensors: the planner plans the device, not the allocator.

A rank's device-level peak (what `nvidia-smi` and an OOM see) is

    tensors                 weights, optimizer state, held gradients and the larger of the
                            transient gradients and the activations (trainer.planner.memory)
  + CUDA context            the context and the kernels a training step loads (lazy loading)
  + NCCL buffers            communicators × channels × connections × NCCL_BUFFSIZE
  + cuBLAS workspaces       cuBLAS + cuBLASLt, one each for the compute stream
  + allocator slack         fragmentation × tensors + a fixed small-block pool; far less
                            with expandable segments (scaling.expandable_segments)

each from the GPU kind's entry in catalog/devices.yaml (with its source), or from a
calibration file `make gpu-check` wrote (trainer.planner.calibration), which wins for the
GPU kind it measured. A job fits only with `margin()` of the GPU left.

Pure (standard library and PyYAML): the planner runs on a laptop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from trainer.planner.calibration import Calibration

if TYPE_CHECKING:
    from trainer.planner.setup import Setup

MIB = 1024**2
MIN_MARGIN = 0.05
"""A GPU job fits only with at least 5% of the GPU left (more where calibration or the run
history measured a larger error for the strategy)."""


@functools.cache
def catalog() -> dict[str, Any]:
    text = resources.files("trainer.planner.catalog").joinpath("devices.yaml").read_text()
    return yaml.safe_load(text)


@dataclass(frozen=True)
class GPUKind:
    name: str
    context: float
    cublas: float
    cublaslt: float
    nccl_channels: int
    source: str
    calibrated: bool = False


def gpu_kind(gpu_model: str | None, calibration: Calibration | None = None) -> GPUKind:
    """The catalog's figures for a GPU kind (its default for an unknown or unnamed one), with
    a matching calibration's measured context."""
    cat = catalog()
    name = gpu_model if gpu_model in cat["gpus"] else cat["default"]
    g = cat["gpus"][name]
    kind = GPUKind(
        name=name,
        context=g["context_mib"] * MIB,
        cublas=g["cublas_mib"] * MIB,
        cublaslt=g["cublaslt_mib"] * MIB,
        nccl_channels=int(g["nccl_channels"]),
        source=str(g["source"]).strip(),
    )
    if calibration is not None and calibration.gpu_model == name and calibration.context_bytes:
        kind = GPUKind(
            name=name,
            context=float(calibration.context_bytes),
            cublas=kind.cublas,
            cublaslt=kind.cublaslt,
            nccl_channels=kind.nccl_channels,
            source=f"calibrated {calibration.date} ({calibration.gpu_name})",
            calibrated=True,
        )
    return kind


def communicators(s: Setup) -> int:
    """NCCL communicators one rank is a member of, by strategy:

    - one rank: none (no process group collective runs);
    - DDP, FSDP2 on one mesh dim: the default process group (1);
    - FSDP2 with tp/pp: the default group, plus one per mesh dim of size > 1 that is not the
      whole world (DeviceMesh reuses the default group for a dim spanning every rank);
      pipeline send/recv counts as the pp dim's;
    - DeepSpeed ZeRO-2/3: the default group and DeepSpeed's own data-parallel group (2).
    """
    if s.world <= 1:
        return 0
    if s.strategy in ("zero2", "zero3"):
        return 2
    if s.strategy == "fsdp" and s.tp * s.pp > 1:
        dp = max(1, s.world // (s.tp * s.pp))
        return 1 + sum(1 for d in (dp, s.tp, s.pp) if 1 < d < s.world)
    return 1


def nccl_per_communicator(kind: GPUKind, nodes: int, calibration: Calibration | None) -> float:
    mine = calibration is not None and calibration.gpu_model == kind.name
    if mine and calibration.nccl_bytes_per_communicator:  # type: ignore[union-attr]
        return float(calibration.nccl_bytes_per_communicator)  # type: ignore[union-attr]
    n = catalog()["nccl"]
    links = n["connections_one_node"] if nodes <= 1 else n["connections_many_nodes"]
    return kind.nccl_channels * links * n["buffsize_mib"] * MIB


def slack_fraction(s: Setup, calibration: Calibration | None, gpu_model: str | None) -> float:
    """The allocator's fragmentation as a share of the tensors: the strategy's calibrated
    figure where one was measured for this GPU kind with the same expandable-segments
    setting, else the catalog's."""
    if calibration is not None and calibration.gpu_model == gpu_kind(gpu_model).name:
        sc = calibration.for_strategy(s.strategy)
        if sc and sc.slack_fraction is not None and sc.expandable_segments == s.expandable_segments:
            return max(0.0, float(sc.slack_fraction))
    a = catalog()["allocator"]
    return float(a["fragmentation_expandable" if s.expandable_segments else "fragmentation"])


@dataclass(frozen=True)
class DeviceLines:
    """One GPU rank's memory outside the modelled tensors, by what holds it."""

    context: float
    nccl: float
    cublas: float
    slack: float
    communicators: int
    channels: int
    connections: int
    slack_fraction: float
    expandable_segments: bool
    gpu: str
    calibrated: bool = False
    context_source: str = "catalog"

    @property
    def total(self) -> float:
        return self.context + self.nccl + self.cublas + self.slack

    def named(self) -> dict[str, float]:
        return {
            "cuda_context": self.context,
            "nccl_buffers": self.nccl,
            "cublas_workspaces": self.cublas,
            "allocator_slack": self.slack,
        }

    def explain(self) -> dict[str, str]:
        """One line of where each figure comes from, for `raylift plan`."""
        mode = "on" if self.expandable_segments else "off"
        nccl = (
            f"{self.communicators} communicator(s) × {self.channels} channels × "
            f"{self.connections} connections × NCCL_BUFFSIZE 4 MiB"
            if self.communicators
            else "one rank: no communicator"
        )
        return {
            "cuda_context": f"{self.gpu}, {self.context_source}",
            "nccl_buffers": nccl,
            "cublas_workspaces": "cuBLAS + cuBLASLt, compute stream",
            "allocator_slack": f"expandable segments {mode}: {self.slack_fraction:.0%} of tensors"
            " + small-block pool",
        }


def device_lines(
    s: Setup,
    tensors: float,
    gpu_model: str | None = None,
    ranks_per_node: int | None = None,
    calibration: Calibration | None = None,
) -> DeviceLines:
    """A GPU rank's device lines for a tensor peak of `tensors` bytes. `ranks_per_node`
    (default: the GPU count of one 8-GPU node) decides whether NCCL crosses nodes."""
    kind = gpu_kind(gpu_model, calibration)
    per_node = ranks_per_node or 8
    nodes = -(-s.world // per_node)
    comms = communicators(s)
    n = catalog()["nccl"]
    links = n["connections_one_node"] if nodes <= 1 else n["connections_many_nodes"]
    frac = slack_fraction(s, calibration, gpu_model)
    fixed = float(catalog()["allocator"]["fixed_mib"]) * MIB
    return DeviceLines(
        context=kind.context,
        nccl=comms * nccl_per_communicator(kind, nodes, calibration),
        cublas=kind.cublas + kind.cublaslt,
        slack=frac * tensors + fixed,
        communicators=comms,
        channels=kind.nccl_channels,
        connections=links,
        slack_fraction=frac,
        expandable_segments=s.expandable_segments,
        gpu=kind.name,
        calibrated=kind.calibrated,
        context_source=kind.source if kind.calibrated else "catalog",
    )


def margin(
    s: Setup,
    calibration: Calibration | None = None,
    history_shortfall: float | None = None,
) -> tuple[float, str]:
    """The share of the GPU a job must leave free to be judged to fit, and why:
    max(5%, the strategy's measured error in the calibration, how far past runs of this
    GPU kind and strategy exceeded their prediction)."""
    best, why = MIN_MARGIN, "the planner's minimum"
    if calibration is not None:
        sc = calibration.for_strategy(s.strategy)
        if sc and sc.error is not None and sc.error > best:
            best, why = float(sc.error), f"{s.strategy}'s error in the calibration"
    if history_shortfall is not None and history_shortfall > best:
        best, why = float(history_shortfall), f"past {s.strategy} runs measured above plan"
    return best, why


def kind_of(device_name: str | None) -> str | None:
    """The catalog's GPU kind for a device name as torch reports it ('NVIDIA H200' -> 'H200')."""
    import re

    if not device_name:
        return None
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    return next((k for k in catalog()["gpus"] if k.upper() in words), None)
