"""The plan says why the RAM tier is off where the planner's host-RAM check turns
`checkpoint.memory_every: auto` off (trainer.planner.tiers.plan_note), with the numbers,
and says nothing where it is on or set by hand."""

from __future__ import annotations

import re

from tests.support.jobs import llama7b_job
from trainer.config import load_config
from trainer.planner.plan import plan_job
from trainer.planner.report import format_plan


def _plan(tmp_path, instance: str, **checkpoint):
    job = llama7b_job(
        tmp_path,
        strategy={"name": "fsdp"},
        scaling={"num_workers": 64, "use_gpu": True},
        checkpoint=checkpoint,
    )
    return plan_job(load_config(job), instance)


def test_the_plan_says_why_the_ram_tier_is_off(tmp_path) -> None:
    small = _plan(tmp_path, "g5.xlarge")  # 16 GiB of host RAM: the keepers do not fit
    lines = [n for n in small.notes if "RAM tier" in n]
    assert len(lines) == 1, small.notes
    got = re.search(
        r"needs ([\d.]+) GiB of host RAM, has (\d+) GiB \(([\d.]+) GiB without\)", lines[0]
    )
    assert got, lines[0]
    need, have, without = map(float, got.groups())
    assert have == 16 and need > have and without < need
    assert lines[0].startswith("RAM tier off (auto)") and "(g5.xlarge)" in lines[0]
    assert f"note: {lines[0]}" in format_plan(small)  # printed, one line
    # where the keepers fit, or the tier is set by hand, the plan says nothing of it
    big = _plan(tmp_path, "g5.4xlarge")
    assert not [n for n in big.notes if "RAM tier" in n], big.notes
    fixed = _plan(tmp_path, "g5.xlarge", memory_every=0)
    assert not [n for n in fixed.notes if "RAM tier" in n], fixed.notes
