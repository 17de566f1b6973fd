"""The shared instance catalog: loads, validates, and stays importable without torch/Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.catalog import Catalog, get_instance, load_catalog, load_instances

ROOT = Path(__file__).resolve().parents[3]


def test_loads_every_family() -> None:
    instances = load_instances()
    for name in [
        f"g5.{s}"
        for s in (
            "xlarge",
            "2xlarge",
            "4xlarge",
            "8xlarge",
            "12xlarge",
            "16xlarge",
            "24xlarge",
            "48xlarge",
        )
    ]:
        assert instances[name].gpu_model == "A10G"
        assert instances[name].gpu_memory_gib == 24
    assert {i.family for i in instances.values()} == {"gpu", "general", "memory", "compute"}
    assert instances["g5.48xlarge"].gpu_count == 8 and instances["g5.48xlarge"].ram_gib == 768
    assert instances["m5.xlarge"].gpu_count == 0
    catalog = load_catalog()
    assert catalog.source and catalog.as_of and catalog.region == "us-east-1"


def test_prices_are_sane() -> None:
    for spec in load_instances().values():
        assert 0 < spec.spot_usd_per_hour <= spec.on_demand_usd_per_hour
        assert spec.usd_per_hour("spot") == spec.spot_usd_per_hour
        assert spec.usd_per_hour("on-demand") == spec.on_demand_usd_per_hour


def test_half_filled_gpu_entry_is_rejected() -> None:
    raw = load_catalog().model_dump()
    raw["instances"]["g5.xlarge"]["gpu_model"] = None
    with pytest.raises(ValueError, match=r"g5\.xlarge"):
        Catalog.model_validate(raw)


def test_unknown_instance_says_where_to_add_it() -> None:
    with pytest.raises(KeyError, match=r"instances\.yaml"):
        get_instance("p9.enormous")


def test_import_pulls_in_no_torch_or_ray() -> None:
    code = (
        "import sys; import trainer.catalog as c; c.load_instances(); "
        "bad = [m for m in ('torch', 'ray', 'boto3', 'pulumi') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
