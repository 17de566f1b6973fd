"""Layouts, verdicts and cost: will this job fit, on which nodes, and what will an epoch cost.

Pure (standard library, pydantic/PyYAML through the config and the catalog; no torch,
Ray, numpy or pyarrow), so the job CLI runs it on a laptop before anything is submitted
and `python -m trainer plan` runs it on a cluster node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.planner import preference, rollouts, sequence
from trainer.planner.catalog import InstanceType, get_instance, load_instances
from trainer.planner.device import MIN_MARGIN
from trainer.planner.device import margin as fit_margin
from trainer.planner.flops import PEAK_FLOPS
from trainer.planner.memory import (
    HostMemory,
    RankMemory,
    host_memory,
    rank_memory,
)
from trainer.planner.setup import Setup, for_model
from trainer.planner.shape import (
    _ORDER,
    DEFAULT_MFU,
    GIB,
    OFFLOAD_MFU,
    TIGHT,
    ModelShape,
    Verdict,
    shape_for_job,
)
from trainer.planner.tiers import plan_note
from trainer.planner.traffic import communication

# ---------------------------------------------------------------- layouts, verdicts, cost


def verdict(need: float, capacity: float) -> Verdict:
    if capacity <= 0 or need > capacity:
        return "does not fit"
    return "tight" if need > TIGHT * capacity else "fits"


@dataclass
class NodeCheck:
    instance: str
    count: int
    ranks_per_node: int
    rank0: bool
    gpu_need: float
    gpu_capacity: float
    gpu_verdict: Verdict | None
    host_need: float
    host_capacity: float
    host_verdict: Verdict
    usd_per_hour: float
    spot_usd_per_hour: float
    large_cpu_mem: bool = False
    """Rank 0's own node type (the large_cpu_mem pool), bought on demand."""

    @property
    def verdict(self) -> Verdict:
        vs = [self.host_verdict] + ([self.gpu_verdict] if self.gpu_verdict else [])
        return max(vs, key=lambda v: _ORDER[v])


@dataclass
class Layout:
    world: int
    nodes: list[NodeCheck]
    tokens_per_s: float | None
    tokens_per_s_source: str

    @property
    def verdict(self) -> Verdict:
        return max((x.verdict for x in self.nodes), key=lambda v: _ORDER[v])

    @property
    def usd_per_hour(self) -> float:
        return sum(x.count * x.usd_per_hour for x in self.nodes)

    @property
    def spot_usd_per_hour(self) -> float:
        """Worker pools on spot; rank 0's large_cpu_mem node stays on demand (infra)."""
        return sum(
            x.count * (x.usd_per_hour if x.large_cpu_mem else x.spot_usd_per_hour)
            for x in self.nodes
        )

    def epoch(self, tokens: int | None) -> dict[str, float] | None:
        if not tokens or not self.tokens_per_s:
            return None
        hours = tokens / self.tokens_per_s / 3600
        return {
            "hours": hours,
            "usd_on_demand": hours * self.usd_per_hour,
            "usd_spot": hours * self.spot_usd_per_hour,
        }

    def describe(self) -> str:
        parts = [f"{x.count}× {x.instance}" + (" (rank 0)" if x.rank0 else "") for x in self.nodes]
        return f"{self.world} workers on " + " + ".join(parts)


def flops_per_token(shape: ModelShape, s: Setup) -> float:
    """6·M for full training (2·M forward, 4·M backward); 4·M with a frozen base (no
    weight gradients); +2·M when activation checkpointing recomputes the forward. M is the
    active parameters (a mixture of experts': those a token is routed through)."""
    base = 4.0 if s.adapter != "none" else 6.0
    return (base + (2.0 if s.checkpointing else 0.0)) * shape.active_params


def throughput(
    shape: ModelShape, s: Setup, inst: InstanceType, mfu: float | None
) -> tuple[float | None, str]:
    """Tokens/s per rank from the catalog GPU's peak FLOP/s at an assumed MFU."""
    if not inst.gpu_model or not s.gpu:
        return None, "no peak FLOP/s for CPU nodes: pass --tokens-per-s"
    peak = PEAK_FLOPS.get(inst.gpu_model, {}).get(s.precision)
    if peak is None:
        return None, f"no peak FLOP/s for {inst.gpu_model} {s.precision}: pass --tokens-per-s"
    mfu = mfu if mfu is not None else (OFFLOAD_MFU if s.offloaded else DEFAULT_MFU)
    tps = peak * mfu / flops_per_token(shape, s)
    return tps, f"{peak / 1e12:.0f} TFLOP/s {inst.gpu_model} × MFU {mfu:.0%}"


def _ranks_on(inst: InstanceType, s: Setup, ranks_per_node: int | None, left: int) -> int:
    if ranks_per_node:
        k = ranks_per_node
    elif s.gpu:
        k = inst.gpu_count
    else:
        k = left  # CPU ranks: all on one node unless told otherwise
    return max(1, min(k, left))


def layout(
    shape: ModelShape,
    s: Setup,
    instance: str,
    rank0_instance: str | None = None,
    ranks_per_node: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
    calibration: Any = None,
    margin: float = MIN_MARGIN,
) -> Layout:
    """Place `s.world` ranks: rank 0's node first (its own type if given), then the pool.
    A GPU node fits only with `margin` of each GPU left (trainer.planner.device.margin)."""
    rank = rank_memory(shape, s)
    host = host_memory(shape, s, rank)
    nodes: list[NodeCheck] = []
    left = s.world
    groups: list[tuple[InstanceType, bool]] = []
    if rank0_instance and rank0_instance != instance:
        groups.append((get_instance(rank0_instance), True))
    groups.append((get_instance(instance), not groups))
    for i, (inst, has_rank0) in enumerate(groups):
        if s.gpu and inst.gpu_count == 0:
            raise UserError(f"{inst.name}: has no GPU but the job sets scaling.use_gpu")
        k = _ranks_on(inst, s, ranks_per_node, left)
        count = math.ceil(left / k) if i == len(groups) - 1 else 1
        on_gpu = rank_memory(shape, s, inst.gpu_model, k, calibration) if s.gpu else rank
        usable = inst.gpu_memory_gib * GIB * (1 - margin)
        for node_index in range(count):
            on_node = min(k, left)
            left -= on_node
            rank0_here = has_rank0 and node_index == 0
            need = host.node_need(on_node, rank0_here)
            check = NodeCheck(
                instance=inst.name,
                count=1,
                ranks_per_node=on_node,
                rank0=rank0_here,
                gpu_need=on_gpu.total if s.gpu else 0.0,
                gpu_capacity=inst.gpu_memory_gib * GIB,
                gpu_verdict=verdict(on_gpu.total, usable) if s.gpu else None,
                host_need=need,
                host_capacity=inst.ram_gib * GIB,
                host_verdict=verdict(need, inst.ram_gib * GIB),
                usd_per_hour=inst.on_demand_usd_per_hour,
                spot_usd_per_hour=inst.spot_usd_per_hour,
                large_cpu_mem=rank0_here and len(groups) > 1,
            )
            _merge_node(nodes, check)
            if left == 0:
                break
    pool = groups[-1][0]  # the pool's type, looked up once above
    if tokens_per_s is not None:
        tps, source = tokens_per_s, "given"
    else:
        per_rank, source = throughput(shape, s, pool, mfu)
        tps = per_rank * s.world if per_rank is not None else None
    return Layout(world=s.world, nodes=nodes, tokens_per_s=tps, tokens_per_s_source=source)


def _merge_node(nodes: list[NodeCheck], check: NodeCheck) -> None:
    """Identical nodes are one row with a count."""
    for x in nodes:
        same = (x.instance, x.ranks_per_node, x.rank0) == (
            check.instance,
            check.ranks_per_node,
            check.rank0,
        )
        if same and not check.rank0:
            x.count += 1
            return
    nodes.append(check)


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    shape: ModelShape
    setup: Setup
    params: int
    trainable: int
    rank: RankMemory
    host: HostMemory
    layout: Layout | None
    cheapest: Layout | None
    tokens_per_epoch: int | None
    notes: list[str] = field(default_factory=list)
    comm: dict[str, float] = field(default_factory=dict)
    """Bytes per rank per optimizer step, by mesh dim (see `communication`)."""
    margin: float = MIN_MARGIN
    """The share of each GPU a fitting job leaves free, and why (trainer.planner.device)."""
    margin_why: str = ""
    history: list[str] = field(default_factory=list)
    """How past runs' device peaks compared with their plans (trainer.planner.history)."""

    @property
    def refused(self) -> bool:
        """What submit refuses: the chosen layout does not fit, or (with none chosen) no
        catalog layout at this worker count does."""
        if self.layout is not None:
            return self.layout.verdict == "does not fit"
        return self.setup.gpu and (self.cheapest is None or self.cheapest.world != self.setup.world)

    def to_dict(self) -> dict[str, Any]:
        def lay(x: Layout | None) -> dict[str, Any] | None:
            if x is None:
                return None
            return {
                "describe": x.describe(),
                "world": x.world,
                "verdict": x.verdict,
                "usd_per_hour": x.usd_per_hour,
                "spot_usd_per_hour": x.spot_usd_per_hour,
                "tokens_per_s": x.tokens_per_s,
                "tokens_per_s_source": x.tokens_per_s_source,
                "epoch": x.epoch(self.tokens_per_epoch),
                "nodes": [{**asdict(n), "verdict": n.verdict} for n in x.nodes],
            }

        return {
            "params": self.params,
            "trainable_params": self.trainable,
            "setup": asdict(self.setup),
            "rank_memory": {**asdict(self.rank), "total": self.rank.total},
            "host_per_rank": asdict(self.host),
            "layout": lay(self.layout),
            "cheapest": lay(self.cheapest),
            "tokens_per_epoch": self.tokens_per_epoch,
            "refused": self.refused,
            "notes": self.notes,
            "comm_bytes_per_step": self.comm,
            "margin": self.margin,
            "margin_why": self.margin_why,
            "history": self.history,
        }


WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)


def plan(
    shape: ModelShape,
    s: Setup,
    instance: str | None = None,
    rank0_instance: str | None = None,
    ranks_per_node: int | None = None,
    tokens_per_epoch: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
    search: bool = True,
    calibration: Any = None,
    history_shortfall: float | None = None,
    history: list[str] | None = None,
) -> Plan:
    margin, why = fit_margin(s, calibration, history_shortfall)
    pool = get_instance(instance) if instance and s.gpu else None
    per_node = ranks_per_node or (pool.gpu_count if pool else None)
    rank = rank_memory(shape, s, pool.gpu_model if pool else None, per_node, calibration)
    trainable = (
        shape.params if s.adapter == "none" else shape.lora_params(s.lora_r, list(s.lora_targets))
    )
    chosen = None
    if instance:
        chosen = layout(
            shape,
            s,
            instance,
            rank0_instance,
            ranks_per_node,
            tokens_per_s,
            mfu,
            calibration,
            margin,
        )
    cheapest = (
        cheapest_layout(shape, s, rank0_instance, tokens_per_epoch, mfu, calibration, margin)
        if search
        else None
    )
    notes = list(rank.notes)
    if cheapest is not None and cheapest.world != s.world:
        notes.append(
            f"nothing in the catalog fits {s.world} workers; the cheapest layout that fits "
            f"uses {cheapest.world} (keep the global batch with grad_accum)"
        )
    return Plan(
        shape=shape,
        setup=s,
        params=shape.params,
        trainable=trainable,
        rank=rank,
        host=host_memory(shape, s, rank),
        layout=chosen,
        cheapest=cheapest,
        tokens_per_epoch=tokens_per_epoch,
        notes=notes,
        comm=communication(shape, s),
        margin=margin,
        margin_why=why,
        history=list(history or []),
    )


def cheapest_layout(
    shape: ModelShape,
    s: Setup,
    rank0_instance: str | None = None,
    tokens_per_epoch: int | None = None,
    mfu: float | None = None,
    calibration: Any = None,
    margin: float = MIN_MARGIN,
) -> Layout | None:
    """The cheapest catalog layout that fits at the job's worker count; failing that, at
    the smallest power-of-two count that fits. Cost is per epoch when the epoch's tokens
    and a throughput are known, else per hour; 'fits' beats 'tight'."""
    family = ("gpu",) if s.gpu else ("compute", "memory", "general")
    types = [t for t in load_instances().values() if t.family in family]
    sizes = [s.world] + [w for w in WORLD_SIZES if w > s.world]
    for world in sizes:
        sw = Setup(**{**asdict(s), "world": world})
        found = []
        for t in types:
            lay = layout(shape, sw, t.name, rank0_instance, None, None, mfu, calibration, margin)
            if lay.verdict != "does not fit":
                found.append(lay)
        if found:

            def cost(x: Layout) -> tuple[int, float]:
                e = x.epoch(tokens_per_epoch)
                return (_ORDER[x.verdict], e["usd_on_demand"] if e else x.usd_per_hour)

            return min(found, key=cost)
    return None


def plan_job(
    cfg: JobConfig,
    instance: str | None = None,
    *,
    rank0_instance: str | None = None,
    params: int | None = None,
    ranks_per_node: int | None = None,
    tokens_per_epoch: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
    read_text: Any = None,
    calibration: Any = None,
    history_shortfall: float | None = None,
    history: list[str] | None = None,
) -> Plan:
    """The plan for a validated job config (the entry point of the CLIs and submit)."""
    shape = ModelShape.from_params(params) if params else shape_for_job(cfg, read_text)
    result = plan(
        shape,
        for_model(Setup.from_config(cfg), shape),
        instance=instance,
        rank0_instance=rank0_instance,
        ranks_per_node=ranks_per_node,
        tokens_per_epoch=tokens_per_epoch,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        calibration=calibration,
        history_shortfall=history_shortfall,
        history=history,
    )
    # A preference objective: pairs, the reference's price, a live reference's.
    chosen = result.layout or result.cheapest
    result.notes += preference.notes(
        preference.cost(
            cfg,
            result.params,
            result.setup,
            chosen.tokens_per_s if chosen else tokens_per_s,
            tokens_per_epoch,
        )
    )
    # Online RL: the rollout's KV cache, a frozen reference, the rollout's compute.
    result.notes += rollouts.notes(
        rollouts.cost(
            cfg, result.shape, result.setup, chosen.tokens_per_s if chosen else tokens_per_s
        )
    )
    result.notes += _sequence_note(cfg, result, instance, rank0_instance, calibration)
    ram_tier = plan_note(cfg, result, shape)  # where the host-RAM check turns auto off
    result.notes += [ram_tier] if ram_tier else []
    from trainer.data.shapes import plan_notes  # which shape each data source is read as

    result.notes += plan_notes(cfg)
    return result


def _sequence_note(
    cfg: JobConfig,
    result: Plan,
    instance: str | None,
    rank0_instance: str | None,
    calibration: Any,
) -> list[str]:
    """Where the job gives data.block_size and leaves strategy.sp unset, and does not fit
    as it is: the smallest sp that fits (trainer.planner.sequence), as a note. The verdict
    stays the job's own (it runs with the sp it sets)."""
    st, s = cfg.strategy, result.setup
    open_sp = "sp" not in st.model_fields_set and "block_size" in cfg.data.model_fields_set
    if not open_sp or not result.refused or cfg.model_parallel > 1:
        return []
    if cfg.train.objective not in sequence.OBJECTIVES or s.tp * s.pp > 1:
        return []

    def fits(candidate: Setup) -> bool:
        p = plan(
            result.shape,
            candidate,
            instance=instance,
            rank0_instance=rank0_instance,
            search=instance is None,
            calibration=calibration,
        )
        return not p.refused

    picked, ok = sequence.smallest_fitting(result.shape, s, fits)
    if not ok:
        return [
            f"strategy.sp: no sequence-parallel size up to {picked.sp} fits "
            f"data.block_size {s.block_size} on {s.world} workers; add workers or "
            "activation checkpointing"
        ]
    per_rank = rank_memory(result.shape, picked).total / GIB
    return [
        f"strategy.sp: {picked.sp} is the smallest sequence-parallel size that fits "
        f"data.block_size {s.block_size} ({per_rank:.1f} GiB a rank); set strategy.sp: "
        f"{picked.sp}"
    ]
