"""Whether the RAM tier fits a node's host RAM: the check that turns `checkpoint.memory_every:
auto` on or off (the driver, before the workers start; the plan says the same).

The keepers' price per node is the planner's (`trainer.planner.memory`: KEEPER_COPIES
snapshots of every share a node's ranks send, the buddy's as many, the ones in transit);
the tier is on only where the node's host RAM holds it beside everything else a rank needs
there (process, offload, checkpoint staging, rank 0's export). Pure: the laptop imports it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainer.planner.memory import host_memory, rank_memory
from trainer.planner.setup import Setup, for_model
from trainer.planner.shape import GIB, shape_for_job


def keeper_need(cfg: Any, ranks_per_node: int, shape: Any = None) -> tuple[float, float]:
    """(host RAM a node needs with the RAM tier on, without it), bytes, rank 0's node."""
    shape = shape if shape is not None else shape_for_job(cfg)
    base = for_model(Setup.from_config(cfg), shape)
    needs = []
    for on in (True, False):
        s = replace(base, memory_tier=on)
        host = host_memory(shape, s, rank_memory(shape, s, None, ranks_per_node))
        needs.append(host.node_need(ranks_per_node, rank0=True))
    return needs[0], needs[1]


def memory_tier_fits(
    cfg: Any, node_ram_bytes: float | None, ranks_per_node: int, shape: Any = None
) -> tuple[bool, str]:
    """(on, why) for `memory_every: auto` on nodes of `node_ram_bytes` (None: unknown, on)."""
    if cfg.strategy.name == "deepspeed":
        return False, "RAM tier off (DeepSpeed: not covered); storage checkpoints alone"
    if node_ram_bytes is None:
        return True, "RAM tier on (auto; node RAM not known here)"
    try:
        with_tier, without = keeper_need(cfg, ranks_per_node, shape)
    except Exception as exc:  # a model the planner cannot size: no guess at its RAM
        return False, f"RAM tier off: its host RAM cannot be sized ({str(exc)[:120]})"
    have = node_ram_bytes / GIB
    if with_tier <= node_ram_bytes:
        return True, (
            f"RAM tier on (auto): keepers fit, {with_tier / GIB:.1f} of {have:.0f} GiB host RAM "
            "on rank 0's node"
        )
    return False, (
        f"RAM tier off (auto): with its keepers a node needs {with_tier / GIB:.1f} GiB of host "
        f"RAM, has {have:.0f} GiB ({without / GIB:.1f} GiB without); storage checkpoints alone"
    )


def plan_note(cfg: Any, plan: Any, shape: Any = None) -> str | None:
    """The plan's line where the host-RAM check turns `memory_every: auto` off: the node
    type of the plan's layout with the least RAM (the one the driver checks), what a node
    would need with the keepers, what it has. None where the tier is on, set by hand, or
    off for another reason (DeepSpeed), or where the plan has no layout."""
    lay = plan.layout or plan.cheapest
    if cfg.checkpoint.memory_every != "auto" or cfg.strategy.name == "deepspeed" or lay is None:
        return None
    if not lay.nodes:
        return None
    node = min(lay.nodes, key=lambda n: n.host_capacity)
    on, why = memory_tier_fits(cfg, node.host_capacity, max(1, node.ranks_per_node), shape)
    return None if on else f"{why} ({node.instance})"
