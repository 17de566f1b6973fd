"""The stack summary: pools, sizes, GPUs and $/hour, priced from the shared instance catalog.

Pure (no Pulumi), so `pulumi preview` output and any tool that reads a stack file agree on what
a cluster costs per hour before anything is created.
"""

from __future__ import annotations

from typing import Any

from infra.catalog import load_catalog
from infra.settings import POOL_MARKETS, StackSettings

# EC2's vCPU quotas (Service Quotas, service code "ec2") by instance family and market. New
# accounts often start low (G and VT on-demand and spot: 0 to 64 vCPUs is common) and a
# request can take days, so the summary says what the stack needs and program.py compares it
# with the account's real values at preview.
QUOTAS: dict[tuple[str, str], tuple[str, str]] = {
    ("G and VT", "on-demand"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("G and VT", "spot"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("X", "on-demand"): ("L-7295265B", "Running On-Demand X instances"),
    ("X", "spot"): ("L-E3A00192", "All X Spot Instance Requests"),
    ("Standard", "on-demand"): (
        "L-1216C47A",
        "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
    ),
    ("Standard", "spot"): (
        "L-34B43A08",
        "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
    ),
}


def quota_class(instance_type: str) -> str:
    """The vCPU quota an instance type counts against (by its family letter)."""
    letter = instance_type[0]
    if letter in "gv":
        return "G and VT"
    if letter == "x":
        return "X"
    return "Standard"


def vcpu_needs(settings: StackSettings) -> dict[str, dict[str, Any]]:
    """vCPUs each quota must allow, keyed by quota code. A spot pool counts its largest listed
    type, since the allocation strategy may hand out any of them."""
    catalog = load_catalog()
    needs: dict[str, dict[str, Any]] = {}
    for pool, spec in settings.pools.by_name().items():
        if spec.capacity == 0:
            continue
        market = POOL_MARKETS[pool]
        by_class: dict[str, int] = {}
        for name in spec.instance_types:
            cls = quota_class(name)
            by_class[cls] = max(by_class.get(cls, 0), catalog.instances[name].vcpus)
        for cls, vcpus in by_class.items():
            code, title = QUOTAS[(cls, market)]
            row = needs.setdefault(code, {"quota": title, "vcpus": 0, "pools": []})
            row["vcpus"] += vcpus * spec.capacity
            row["pools"].append(pool)
    return dict(sorted(needs.items()))


def pool_summary(settings: StackSettings) -> dict[str, Any]:
    """Per pool: market, types, node count, GPUs and estimated $/hour; plus cluster totals.

    `nodes`, `gpus` and `usdPerHour` are the pool at its maximum (a job that fills it);
    `idleNodes` and `idleUsdPerHour` what it holds, and costs, while no job runs: minNodes
    with autoscaling, everything without (and the head, always).

    Spot pools are priced at the first listed type's *typical* spot price (the allocation
    strategy may pick another listed type), so treat spot figures as estimates.
    """
    catalog = load_catalog()
    pools: dict[str, Any] = {}
    total_usd = 0.0
    idle_usd = 0.0
    total_gpus = 0
    for pool, spec in settings.pools.by_name().items():
        market = POOL_MARKETS[pool]
        first = catalog.instances[spec.instance_types[0]]
        usd = round(first.usd_per_hour(market) * spec.capacity, 3)
        gpus = first.gpu_count * spec.capacity
        idle = (
            spec.capacity if pool == "head" or not settings.autoscaling.enabled else spec.min_nodes
        )
        pools[pool] = {
            "market": market,
            "instanceTypes": list(spec.instance_types),
            "nodes": spec.capacity,
            "idleNodes": idle,
            "gpusPerNode": first.gpu_count,
            "gpus": gpus,
            "ramGibPerNode": first.ram_gib,
            "usdPerHour": usd,
            "idleUsdPerHour": round(first.usd_per_hour(market) * idle, 3),
        }
        total_usd += usd
        idle_usd += pools[pool]["idleUsdPerHour"]
        total_gpus += gpus
    return {
        "pools": pools,
        "totalNodes": sum(p["nodes"] for p in pools.values()),
        "totalGpus": total_gpus,
        "totalUsdPerHour": round(total_usd, 3),
        "idleUsdPerHour": round(idle_usd, 3),
        "autoscaling": settings.autoscaling.enabled,
        "vcpuQuotasNeeded": vcpu_needs(settings),
        "priceSource": f"{catalog.display_path} ({catalog.region}, as of {catalog.as_of})",
    }
