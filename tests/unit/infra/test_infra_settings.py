"""Stack settings: defaults, merging and one-line errors that name the stack key."""

from __future__ import annotations

import pytest

from infra.settings import SettingsError, parse_settings
from infra.summary import pool_summary

IMAGE = {"image": {"tag": "trainer-gpu-0.1.0-abcdef0"}}


def test_defaults() -> None:
    s = parse_settings(IMAGE)
    pools = s.pools.by_name()
    assert list(pools) == ["head", "gpu-ondemand", "gpu-spot", "large-cpu-mem", "cpu"]
    assert pools["head"].size == 1 and pools["head"].instance_types == ["m5.xlarge"]
    # Default rank-0 node is sized for the 70b preset.
    assert pools["large-cpu-mem"].instance_types == ["g5.48xlarge"]
    assert s.ray.token_auth is True
    assert s.registry.repositories == ["base", "bnb", "ccl", "trainer"]


def test_pool_overrides_merge_onto_defaults() -> None:
    s = parse_settings({**IMAGE, "pools": {"gpuSpot": {"size": 7}}})
    spot = s.pools.gpu_spot
    assert spot.size == 7
    assert spot.instance_types == ["g5.4xlarge", "g5.8xlarge", "g5.2xlarge"]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"pools": {"gpuSpto": {"size": 1}}}, "raylift:pools.gpuSpto"),
        ({"pools": {"cpu": {"instanceTypes": ["c9.mega"]}}}, "raylift:pools.cpu.instanceTypes"),
        ({"pools": {"head": {"size": 2}}}, "raylift:pools"),
        ({"pools": {"largeCpuMem": {"size": 2}}}, "raylift:pools"),
        (
            {"pools": {"gpuOnDemand": {"instanceTypes": ["g5.xlarge", "g5.2xlarge"]}}},
            "raylift:pools",
        ),
        ({"pools": {"gpuSpot": {"instanceTypes": ["g5.4xlarge", "g5.12xlarge"]}}}, "gpuSpot"),
        ({"image": {"tag": "latest"}}, "raylift:image.tag"),
        ({"image": {"tag": "1", "repository": "nope"}}, "raylift:"),
        ({"network": {"vpcCidr": "10.0.0.0/24"}}, "raylift:network.vpcCidr"),
        ({"network": {"existingVpcId": "vpc-1"}}, "raylift:network"),
        ({"ray": {"dashboardAgentListenPort": 40000}}, "raylift:ray"),
        ({"storage": {"mountPath": "relative"}}, "raylift:storage.mountPath"),
        ({"clusterName": "Bad_Name"}, "raylift:clusterName"),
    ],
)
def test_errors_name_the_key(raw: dict, key: str) -> None:
    data = {**IMAGE, **raw}
    with pytest.raises(SettingsError) as exc:
        parse_settings(data)
    message = str(exc.value)
    assert key in message
    assert "\n" not in message


def test_image_tag_is_optional_until_pushed() -> None:
    # No tag yet: the first `pulumi up` makes the repositories `make push` needs.
    assert parse_settings({}).image.tag is None
    with pytest.raises(SettingsError, match=r"raylift:image.tag"):
        parse_settings({"image": {"tag": "trainer-gpu-latest"}})


def test_summary_totals() -> None:
    s = parse_settings({**IMAGE, "pools": {"gpuSpot": {"size": 2}, "largeCpuMem": {"size": 0}}})
    summary = pool_summary(s)
    # m5.xlarge on-demand 0.192 + 2 × g5.4xlarge typical spot 0.70
    assert summary["totalUsdPerHour"] == pytest.approx(0.192 + 2 * 0.70)
    assert summary["totalGpus"] == 2
    assert summary["totalNodes"] == 3
