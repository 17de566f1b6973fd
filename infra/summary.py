"""The stack summary: pools, sizes, GPUs and $/hour, priced from the shared instance catalog.

Pure (no Pulumi), so `pulumi preview` output and any tool that reads a stack file agree on what
a cluster costs per hour before anything is created.
"""

from __future__ import annotations

from typing import Any

from infra.settings import POOL_MARKETS, StackSettings
from trainer.catalog import load_catalog


def pool_summary(settings: StackSettings) -> dict[str, Any]:
    """Per pool: market, types, node count, GPUs and estimated $/hour; plus cluster totals.

    Spot pools are priced at the first listed type's *typical* spot price (the allocation
    strategy may pick another listed type), so treat spot figures as estimates.
    """
    catalog = load_catalog()
    pools: dict[str, Any] = {}
    total_usd = 0.0
    total_gpus = 0
    for pool, spec in settings.pools.by_name().items():
        market = POOL_MARKETS[pool]
        first = catalog.instances[spec.instance_types[0]]
        usd = round(first.usd_per_hour(market) * spec.size, 3)
        gpus = first.gpu_count * spec.size
        pools[pool] = {
            "market": market,
            "instanceTypes": list(spec.instance_types),
            "nodes": spec.size,
            "gpusPerNode": first.gpu_count,
            "gpus": gpus,
            "ramGibPerNode": first.ram_gib,
            "usdPerHour": usd,
        }
        total_usd += usd
        total_gpus += gpus
    return {
        "pools": pools,
        "totalNodes": sum(p["nodes"] for p in pools.values()),
        "totalGpus": total_gpus,
        "totalUsdPerHour": round(total_usd, 3),
        "priceSource": f"trainer/catalog/instances.yaml ({catalog.region}, as of {catalog.as_of})",
    }
