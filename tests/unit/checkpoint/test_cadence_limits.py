"""The cadence's limits and its outside signals (trainer.planner.cadence): the storage
interval's wall-time cap (checkpoint.max_interval_s) and a rebalance recommendation that
shortens the intervals of the running job (trainer.resilience.rebalance)."""

from __future__ import annotations

from dataclasses import replace

from trainer.planner import cadence as cad
from trainer.planner.cadence import Cadence, Costs, Rates, decide

HOUR = 3600.0


def test_the_storage_interval_is_capped_in_wall_time() -> None:
    """Priors on a small on-demand cluster: storage covers the driver's loss (once a month),
    Young says most of an hour between saves; checkpoint.max_interval_s bounds it (and the
    RAM tier's, of which it is a multiple) in seconds of training, never below the write
    floor."""
    rates = cad.prior_rates(2, 1, None)
    costs = Costs(step_s=0.5, memory_stall_s=0.01, storage_stall_s=2.0, storage_write_s=5.0)
    free = decide(costs, rates, memory_tier=True, max_overhead=0.02, max_interval_s=None)
    assert free.storage_every * 0.5 > 2400.0  # what the rule alone gives
    assert free.memory_every * 0.5 > 1200.0
    capped = decide(costs, rates, memory_tier=True, max_overhead=0.02, max_interval_s=600.0)
    assert capped.reasons == {cad.RAM: "max_interval", cad.STORAGE: "max_interval"}
    assert capped.storage_every * 0.5 == 600.0 and capped.memory_every * 0.5 == 600.0
    assert capped.inputs["max_interval_s"] == 600.0
    longer = decide(costs, rates, memory_tier=True, max_interval_s=1800.0)
    assert longer.storage_every * 0.5 <= 1800.0 and longer.storage_every % longer.memory_every == 0
    # no failures at all: the cap still gives a finite interval
    calm = decide(costs, Rates(0.0, 0.0), memory_tier=False, max_interval_s=60.0)
    assert calm.storage_every == 120
    # the write floor wins over the cap (writes never queue)
    slow = replace(costs, storage_write_s=4000.0)
    floor = decide(slow, rates, memory_tier=True, max_interval_s=1800.0)
    assert floor.reasons[cad.STORAGE] == "write" and floor.storage_every * 0.5 >= 4000.0
    # the run's component carries the config's cap into every decision
    c = Cadence(rates, memory_tier=True, max_interval_s=600.0)
    for _ in range(3):
        c.step_time(0.5)
    c.saved(cad.RAM, 0.01)
    c.saved(cad.STORAGE, 2.0)
    c.decide_alone()
    assert c.decision is not None and c.decision.storage_every * 0.5 <= 600.0
    assert c.decision.memory_every * 0.5 <= 600.0
