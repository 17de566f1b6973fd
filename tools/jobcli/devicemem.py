"""Planned against measured memory per rank, for `raylift report` and `raylift status`: the
planner's device-level total for the job the driver recorded (<run>/job.json), beside the
device-level peaks the workers measured per phase (trainer.observability.device_memory,
gathered into the metrics records as `dev_<phase>_gib`). On CPU ranks both are host RAM:
the planner's per-rank figure and the process's resident set."""

from __future__ import annotations

from collections import Counter
from typing import Any

from trainer.observability.device_memory import PHASES

GIB = 1024**3
SHORT = {"first_step": "first step", "steady_step": "steady"}
LINE = {
    "cuda_context": "context",
    "nccl_buffers": "NCCL",
    "cublas_workspaces": "cuBLAS",
    "allocator_slack": "slack",
}


def measured(
    steps: list[dict[str, Any]], finals: list[dict[str, Any]] | None = None
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Each rank's peak per phase (what each rank wrote at the end of its attempt, else the
    newest record that lists every rank), and the largest over all ranks and records per
    phase."""
    per_rank: list[dict[str, float]] = []
    top: dict[str, float] = {}
    for rec in steps:
        for p in PHASES:
            v = rec.get(f"dev_{p}_gib_max")
            if v:
                top[p] = max(top.get(p, 0.0), float(v))
        ranks = rec.get("per_rank") or {}
        if f"dev_{PHASES[0]}_gib" in ranks:
            n = len(ranks[f"dev_{PHASES[0]}_gib"])
            per_rank = [
                {p: float(ranks.get(f"dev_{p}_gib", [0.0] * n)[r]) for p in PHASES}
                for r in range(n)
            ]
    if finals:
        per_rank = [{p: float(f.get(f"dev_{p}_gib") or 0.0) for p in PHASES} for f in finals]
    for phases in per_rank:
        for p, v in phases.items():
            top[p] = max(top.get(p, 0.0), v)
    return per_rank, top


def planned(job: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[Any, str]:
    """The planner's rank memory for the recorded job on the GPU kind its nodes were."""
    from trainer.config import JobConfig
    from trainer.planner.catalog import get_instance
    from trainer.planner.memory import Setup, rank_memory
    from trainer.planner.shape import ModelShape, shape_for_job

    cfg = JobConfig.model_validate(job["config"])
    try:  # the model's own shape where its config.json is readable from here
        shape = shape_for_job(cfg)
    except Exception:
        if not job.get("params"):
            raise
        shape = ModelShape.from_params(job["params"])  # a reference shape of that size
    types = Counter(n["instance_type"] for n in nodes if n.get("instance_type"))
    gpu_model, per_node, where = None, None, "the catalog's default GPU"
    for name, _ in types.most_common():
        inst = get_instance(name)
        if inst.gpu_model:
            gpu_model, per_node, where = inst.gpu_model, inst.gpu_count, name
            break
    s = Setup.from_config(cfg)
    if not s.gpu:
        where = "host RAM per CPU rank"
    return rank_memory(shape, s, gpu_model, per_node), where


def device_memory_lines(
    job: dict[str, Any] | None,
    nodes: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    finals: list[dict[str, Any]] | None = None,
) -> list[str]:
    per_rank, top = measured(steps, finals)
    if not per_rank and not top:
        return []
    lines = []
    plan_total = None
    if job:
        try:
            rank, where = planned(job, nodes)
            plan_total = rank.total
            parts = " + ".join(
                [f"tensors {rank.tensors / GIB:.2f}"]
                + [f"{LINE.get(k, k)} {v / GIB:.2f}" for k, v in rank.device.items()]
            )
            if not rank.device:
                parts += f" + process {rank.overhead / GIB:.2f}"
            lines.append(f"memory: planned {plan_total / GIB:.2f} GiB per rank ({where}: {parts})")
        except Exception as exc:  # a job this planner cannot plan: say so, keep the measures
            lines.append(f"memory: no plan for this job ({str(exc).splitlines()[0][:160]})")
    for r, phases in enumerate(per_rank):
        peak = max(phases.values())
        seen = ", ".join(f"{SHORT.get(p, p)} {v:.2f}" for p, v in phases.items() if v)
        ratio = f", {peak * GIB / plan_total:.2f} of plan" if plan_total else ""
        lines.append(f"memory: rank {r} measured peak {peak:.2f} GiB ({seen}){ratio}")
    if top and plan_total:
        worst = max(top.values())
        verdict = "within plan" if worst * GIB <= plan_total else "ABOVE PLAN"
        lines.append(
            f"memory: largest measured {worst:.2f} GiB against planned "
            f"{plan_total / GIB:.2f} GiB ({worst * GIB / plan_total:.2f}: {verdict})"
        )
    return lines
