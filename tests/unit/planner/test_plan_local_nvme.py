"""The plan names each node type's instance-store NVMe (what the boot mounts at
/mnt/local_storage), and warns where a DeepSpeed NVMe offload lands on a node without one."""

from __future__ import annotations

from trainer.planner.memory import Setup
from trainer.planner.plan import plan
from trainer.planner.report import format_plan
from trainer.planner.shape import ModelShape

L70 = ModelShape(8192, 80, 64, 8, 28672, 32000)


def _zero3(offload: str, gpu: bool = True) -> Setup:
    return Setup(
        strategy="zero3", world=8, micro_batch=1, block_size=1024, gpu=gpu,
        checkpointing=True, offload_optimizer=offload, offload_param=offload,
    )  # fmt: skip


def _rows(text: str, instance: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip().startswith(instance)]


def test_each_node_type_shows_its_local_nvme():
    text = format_plan(plan(L70, _zero3("nvme"), instance="g5.12xlarge", search=False))
    assert "local NVMe" in text
    rows = _rows(text, "g5.12xlarge")
    assert rows and all("3,800 GB" in row for row in rows)
    assert "has no instance-store NVMe" not in text


def test_an_nvme_offload_on_a_node_without_instance_store_is_flagged():
    text = format_plan(plan(L70, _zero3("nvme", False), instance="r6i.32xlarge", search=False))
    rows = _rows(text, "r6i.32xlarge")
    assert rows and all(" none " in row for row in rows)
    assert "r6i.32xlarge has no instance-store NVMe" in text
    # Without an NVMe offload the same node is only described, not flagged.
    quiet = format_plan(plan(L70, _zero3("cpu", False), instance="r6i.32xlarge", search=False))
    assert "has no instance-store NVMe" not in quiet
