"""The shared instance catalog: loads, validates, and stays importable without torch/Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.planner.catalog import Catalog, get_instance, load_catalog, load_instances

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


def test_every_gpu_node_lists_its_instance_store_nvme() -> None:
    # The boot formats it at /mnt/local_storage; the planner and doctor report it.
    gpus = {n: s for n, s in load_instances().items() if s.family == "gpu"}
    assert gpus and all(s.nvme_gb >= 250 and s.nvme_devices >= 1 for s in gpus.values())
    assert (get_instance("g5.xlarge").nvme_gb, get_instance("g5.12xlarge").nvme_gb) == (250, 3800)
    assert get_instance("g5.48xlarge").nvme_devices == 2  # the boot builds a RAID 0
    assert get_instance("m5.xlarge").nvme_gb == 0
    raw = load_catalog().model_dump()
    raw["instances"]["g5.xlarge"]["nvme_devices"] = 0
    with pytest.raises(ValueError, match=r"g5\.xlarge: nvme_gb and nvme_devices"):
        Catalog.model_validate(raw)


def test_unknown_instance_says_where_to_add_it() -> None:
    with pytest.raises(KeyError, match=r"instances\.yaml"):
        get_instance("p9.enormous")


def test_import_pulls_in_no_torch_or_ray() -> None:
    code = (
        "import sys; import trainer.planner.catalog as c; c.load_instances(); "
        "bad = [m for m in ('torch', 'ray', 'boto3', 'pulumi') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---- infra/'s own loader of the same file (infra imports nothing from trainer/)


def test_infra_reads_the_same_facts_as_the_planner() -> None:
    from infra.catalog import CATALOG_FILE
    from infra.catalog import load_catalog as infra_catalog

    ours = infra_catalog()
    assert ours.path == CATALOG_FILE
    assert ours.display_path == "trainer/planner/catalog/instances.yaml"
    planner = load_instances()
    assert set(ours.instances) == set(planner)
    for name, spec in ours.instances.items():
        theirs = planner[name]
        assert (spec.vcpus, spec.ram_gib, spec.gpu_count) == (
            theirs.vcpus,
            theirs.ram_gib,
            theirs.gpu_count,
        ), name
        for market in ("on-demand", "spot"):
            assert spec.usd_per_hour(market) == theirs.usd_per_hour(market), name
    assert (ours.region, ours.as_of) == (load_catalog().region, load_catalog().as_of)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, r"broken\.yaml: instance catalog not found .*RAYLIFT_INSTANCE_CATALOG"),
        ("region: x\ninstances: {a: [1,\n", r"broken\.yaml:3: catalog is not valid YAML"),
        ("- just a list\n", r"broken\.yaml: instance catalog must be a mapping"),
        (
            "region: r\nas_of: '1'\ninstances:\n  g5.xlarge: {vcpus: 0, ram_gib: 16,"
            " on_demand_usd_per_hour: 1, spot_usd_per_hour: 0.5}\n",
            r"broken\.yaml: instances\.g5\.xlarge\.vcpus: Input should be greater than 0",
        ),
    ],
    ids=["missing", "bad-yaml", "not-a-mapping", "bad-entry"],
)
def test_a_broken_catalog_stops_preview_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None, expected: str
) -> None:
    from infra.catalog import CATALOG_ENV, CatalogError
    from infra.settings import parse_settings

    path = tmp_path / "broken.yaml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv(CATALOG_ENV, str(path))
    # parse_settings is what `pulumi preview` runs first (program.read_settings turns the
    # error into a RunError, which the CLI prints without a traceback).
    with pytest.raises(CatalogError, match=expected) as err:
        parse_settings({"image": {"tag": "trainer-gpu-1.2.3-abcdef0"}})
    assert "\n" not in str(err.value)
