"""gpu-check's calibration: the planner's device-level figures for a measured job, and the
calibration file a GPU run writes (the measured CUDA context and each strategy's allocator
slack), which trainer.planner.calibration reads back.
"""

from __future__ import annotations

import os
from typing import Any


def device_figures(shape: Any, setup: Any, device: str, ranks: list[dict]) -> dict[str, Any]:
    """The planner's device-level total on this GPU kind (the catalog's figures) against
    the measured device-level peak, and the parts the calibration is made from."""
    from trainer.planner.device import kind_of
    from trainer.planner.memory import rank_memory

    kind = kind_of(device)
    dev = rank_memory(shape, setup, kind, setup.world)
    peaks = [r.get("device_peak") or 0 for r in ranks]
    contexts = sorted(r["context_bytes"] for r in ranks if r.get("context_bytes"))
    out: dict[str, Any] = {
        "gpu_model": kind,
        "tensors": dev.tensors,
        "device_lines": dev.device,
        "device_predicted": dev.total,
        "device_peak": max(peaks) or None,
        "context_bytes": contexts[len(contexts) // 2] if contexts else None,
    }
    if out["device_peak"]:
        out["device_over_measured"] = dev.total / out["device_peak"]
    return out


def calibration_from(results: list[dict[str, Any]], meta: dict[str, str]) -> Any:
    """The calibration file's content from a GPU run's rows: the measured context (median
    over the jobs), and per strategy the allocator's slack as a share of the tensors (the
    measured device peak less the tensors, the context and the catalog's NCCL and cuBLAS
    lines, on one GPU), and the error of the calibrated model on the other GPU counts."""
    from trainer.planner.calibration import Calibration, StrategyCalibration
    from trainer.planner.device import MIB, catalog

    pool = catalog()["allocator"]["fixed_mib"] * MIB  # the slack line's small-block pool
    rows = [r for r in results if r.get("device_peak") and r.get("gpu_model")]
    if not rows:
        return None
    contexts = sorted(r["context_bytes"] for r in rows if r.get("context_bytes"))
    context = contexts[len(contexts) // 2] if contexts else None
    strategies: dict[str, StrategyCalibration] = {}
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["world"])
        base = mine[0]

        def fixed(r: dict[str, Any]) -> float:
            lines = r["device_lines"]
            ctx = context if context is not None else lines["cuda_context"]
            return ctx + lines["nccl_buffers"] + lines["cublas_workspaces"] + pool

        slack = max(0.0, (base["device_peak"] - base["tensors"] - fixed(base)) / base["tensors"])
        errors = [
            abs(r["tensors"] * (1 + slack) + fixed(r) - r["device_peak"]) / r["device_peak"]
            for r in mine[1:]
        ]
        strategies[name] = StrategyCalibration(
            slack_fraction=slack,
            expandable_segments=meta.get("expandable_segments", "true") == "true",
            predicted=base["device_predicted"],
            measured=base["device_peak"],
            error=max(errors) if errors else None,
        )
    return Calibration(
        gpu_name=meta.get("gpu_name", ""),
        gpu_model=rows[0]["gpu_model"],
        torch=meta.get("torch", ""),
        cuda=meta.get("cuda", ""),
        nccl=meta.get("nccl", ""),
        date=meta.get("date", ""),
        context_bytes=context,
        strategies=strategies,
    )


def run_meta(device: str) -> dict[str, str]:
    import datetime

    import torch

    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # a build without NCCL
        nccl = ""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return {
        "gpu_name": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "nccl": nccl,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        # The workers set expandable segments unless this environment set its own.
        "expandable_segments": "false"
        if conf and "expandable_segments:True" not in conf
        else "true",
    }
