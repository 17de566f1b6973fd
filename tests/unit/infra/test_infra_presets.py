"""The 7b/13b/70b presets create exactly the pools their README tables promise."""

from __future__ import annotations

import re

import pytest
from infra_stack import INFRA, StackRunner, stack_file_config

from trainer.planner.catalog import get_instance

# From Ray's Llama-2 DeepSpeed template reference runs (USERS.md): one A10G per Ray worker.
REFERENCE_GPUS = {"7b": 16, "13b": 16, "70b": 32}


def readme_table(preset: str) -> dict[str, dict]:
    """Parse the preset's table out of infra/README.md (the document users read)."""
    text = (INFRA / "README.md").read_text()
    match = re.search(
        rf"<!-- preset-table:{preset} -->(.*?)<!-- /preset-table -->", text, flags=re.S
    )
    assert match, f"README has no table for preset {preset}"
    rows = [
        line
        for line in match.group(1).splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    ]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["pool", "market", "instance types", "nodes", "GPUs"]
    table = {}
    for row in rows[1:]:
        pool, market, types, nodes, gpus = (c.strip() for c in row.strip("|").split("|"))
        table[pool] = {
            "market": market,
            "types": [t.strip() for t in types.split(",")],
            "nodes": int(nodes),
            "gpus": int(gpus),
        }
    return table


@pytest.mark.parametrize("preset", sorted(REFERENCE_GPUS))
def test_preset_matches_readme_table(run_stack: StackRunner, preset: str) -> None:
    stack = run_stack(stack_file_config(INFRA / "presets" / f"{preset}.yaml"))
    table = readme_table(preset)
    made = {
        name: {
            "market": pool.market,
            "types": pool.instance_types,
            "nodes": pool.size,
            "gpus": get_instance(pool.instance_types[0]).gpu_count * pool.size,
        }
        for name, pool in stack.pools.items()
    }
    assert made == table


@pytest.mark.parametrize("preset", sorted(REFERENCE_GPUS))
def test_preset_gpu_total_matches_reference_run(run_stack: StackRunner, preset: str) -> None:
    stack = run_stack(stack_file_config(INFRA / "presets" / f"{preset}.yaml"))
    gpus = sum(get_instance(p.instance_types[0]).gpu_count * p.size for p in stack.pools.values())
    assert gpus == REFERENCE_GPUS[preset]
    assert stack.outputs["summary"]["totalGpus"] == gpus
    # Rank 0's node: labelled for placement and one of the pool's GPU workers.
    lcm = stack.pools["large-cpu-mem"]
    assert lcm.size == 1
    assert lcm.labels["large_cpu_mem"] == "true"
    assert lcm.resources == {"large_cpu_mem": 1}


@pytest.mark.parametrize(("preset", "params_billion"), [("7b", 7), ("13b", 13), ("70b", 70)])
def test_rank0_node_fits_gathered_model(
    run_stack: StackRunner, preset: str, params_billion: int
) -> None:
    """The large_cpu_mem node holds the gathered fp32 model (4 B/param) plus, per local rank,
    its ZeRO-3 offloaded share of fp32 params + Adam moments + fp16 params/grads (16 B/param
    spread over all ranks), with 20% headroom for the OS, Ray and pinned buffers."""
    stack = run_stack(stack_file_config(INFRA / "presets" / f"{preset}.yaml"))
    spec = get_instance(stack.pools["large-cpu-mem"].instance_types[0])
    params = params_billion * 1e9
    world = REFERENCE_GPUS[preset]
    need_gb = (4 * params + spec.gpu_count * 16 * params / world) / 1e9 * 1.2
    assert spec.ram_gib * 1.073741824 >= need_gb, (spec.name, need_gb)


# vCPUs per EC2 quota each preset needs (spot pools counted at their largest listed type); the
# README's "vCPU quotas and capacity" section quotes these figures.
PRESET_QUOTAS = {
    "7b": {"L-3819A6DF": 15 * 32, "L-DB2E81BA": 32, "L-1216C47A": 4},
    "13b": {"L-3819A6DF": 15 * 64, "L-DB2E81BA": 64, "L-1216C47A": 4},
    "70b": {"L-DB2E81BA": 4 * 192, "L-1216C47A": 8},
}


@pytest.mark.parametrize("preset", sorted(PRESET_QUOTAS))
def test_preset_vcpu_quotas_are_reported(run_stack: StackRunner, preset: str) -> None:
    stack = run_stack(stack_file_config(INFRA / "presets" / f"{preset}.yaml"))
    needs = stack.outputs["summary"]["vcpuQuotasNeeded"]
    assert {code: row["vcpus"] for code, row in needs.items()} == PRESET_QUOTAS[preset]
    readme = (INFRA / "README.md").read_text().replace("\n", " ")
    gpu_vcpus = PRESET_QUOTAS[preset].get("L-3819A6DF") or PRESET_QUOTAS[preset]["L-DB2E81BA"]
    assert (
        f"{preset} preset needs {gpu_vcpus}" in readme or f"{preset} preset {gpu_vcpus}" in readme
    )
    # The preview warns where the (mocked, 64-vCPU) account quota is too low.
    assert any(str(gpu_vcpus) + " vCPUs" in w for w in stack.warnings)
