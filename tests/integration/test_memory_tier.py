"""The RAM tier (trainer.checkpoint.memory) on a real Ray cluster on 127.0.0.1: a head and
two one-CPU nodes, a tiny Llama on gloo (DDP, FSDP2 alone and under tp=2 and pp=2, LoRA
and QLoRA on DDP and on FSDP2), a snapshot every step, a storage checkpoint every 10. A
hard kill costs at most a step or two and restores from the keepers' memory: a SIGKILLed
worker from its node's keeper, a node lost without grace from the buddy copy, both copies
lost from storage, and a kill while a buddy copy is held makes every rank restore the
same older step. Every run ends with the weights of an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.support.background import BackgroundRun
from tests.support.jobs import base_job
from tests.support.ray_jobs import history, launch, run_driver, wait_for
from tools.jobcli.follow import follow
from trainer.checkpoint import manager as ckpt_mod
from trainer.checkpoint.keeper import OWN
from trainer.observability.metrics import read_records
from trainer.resilience import journal
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow

STEPS, EVERY = 40, 10
FINAL = f"export/{ckpt_mod.dir_name(STEPS)}/model"


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """An exported model's weights, from its one file or its shards (one per pipeline
    stage)."""
    files = sorted(model_dir.glob("model*.safetensors"))
    assert files, f"no weights in {model_dir}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def memory_job(
    root: Path, tiny: dict[str, Path], name: str, memory_every: int = 1, **sections: Any
) -> Path:
    data = base_job(tiny, root / "runs", name)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["train"].update({"max_steps": STEPS, "eval_every": None, "log_every": 1})
    data["checkpoint"].update({"every_steps": EVERY, "keep_last": 2, "memory_every": memory_every})
    data["run"].update({"max_failures": 5})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Reference:
    """An uninterrupted run (torchrun: the same loop and gloo reductions, no RAM tier),
    started in the background; `weights()` waits for it and reads what the test compares."""

    def __init__(self, root: Path, tiny: dict[str, Path], name: str, **sections: Any) -> None:
        self.name, self.root = name, root
        self.run = BackgroundRun(memory_job(root, tiny, name, memory_every=0, **sections))

    def weights(self, adapter: bool = False) -> dict[str, torch.Tensor]:
        self.run.wait()
        if adapter:
            return load_file(str(self.root / "runs" / self.name / FINAL_ADAPTER))
        return _weights(self.root / "runs" / self.name / FINAL)


# tp's dcp/2 shards travel the same way as pp's stages and FSDP2's shards (each rank's files
# are its share); test_parallel resumes tp checkpoints across layouts. CI's time keeps pp.
LAYOUTS = {"pp2": {"pp": 2, "microbatches": 2}}

FINAL_ADAPTER = f"export/{ckpt_mod.dir_name(STEPS)}/adapter/adapter_model.safetensors"
# DDP (rank 0 writes the adapter) and FSDP2 (each rank its shard), LoRA on one and QLoRA on
# the other: the two other pairs add nothing the snapshot path treats differently. CI keeps
# QLoRA on FSDP2 (a snapshot of only what trains, sharded); LoRA on DDP runs in make bench
# (bench_only, issue 56): rank 0's share of a DDP snapshot is the DDP test's, and a
# snapshot of only the adapters is QLoRA's.
ADAPTERS = [pytest.param("lora-ddp", marks=pytest.mark.bench_only), "qlora-fsdp"]


def _adapter_sections(name: str) -> dict[str, Any]:
    adapter, strategy = name.split("-")
    return {"model": {"adapter": adapter}, "strategy": {"name": strategy}}


# What each reference trains, by name: DDP, FSDP2, each layout and each adapter pair.
REFERENCES: dict[str, dict[str, Any]] = {
    "mem-ref": {},
    "mem-ref-fsdp": {"strategy": {"name": "fsdp"}},
    **{f"mem-ref-{n}": {"strategy": {"name": "fsdp", **lay}} for n, lay in LAYOUTS.items()},
    **{f"mem-ref-{n}": _adapter_sections(n) for n in ("lora-ddp", "qlora-fsdp")},
}
# The ones CI's cases compare against start together, when the first test asks for any:
# they train while the first Ray jobs start up (issue 56). make bench's start on demand.
CI_REFERENCES = ("mem-ref", "mem-ref-pp2", "mem-ref-qlora-fsdp")


class References:
    def __init__(self, root: Path, tiny: dict[str, Path]) -> None:
        self.root, self.tiny = root, tiny
        self.started: dict[str, Reference] = {}

    def start(self, name: str) -> Reference:
        """The named reference, started now if it is not running yet."""
        if name not in self.started:
            self.started[name] = Reference(self.root, self.tiny, name, **REFERENCES[name])
        return self.started[name]

    def stop(self) -> None:
        for ref in self.started.values():
            ref.run.stop()


@pytest.fixture(scope="module")
def references(tiny, tmp_path_factory):
    refs = References(tmp_path_factory.mktemp("memref"), tiny)
    try:
        for name in CI_REFERENCES:
            refs.start(name)  # waited for by the test that compares against it
        yield refs
    finally:
        refs.stop()


@pytest.fixture(scope="module")
def reference(references) -> Reference:
    return references.start("mem-ref")


@pytest.fixture(scope="module")
def fsdp_reference(references) -> Reference:
    return references.start("mem-ref-fsdp")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_reference(request, references) -> tuple[str, Reference]:
    """FSDP2 under pipeline parallelism (dcp/2), uninterrupted: final weights."""
    return request.param, references.start(f"mem-ref-{request.param}")


@pytest.fixture(scope="module", params=ADAPTERS)
def adapter_reference(request, references) -> tuple[str, Reference]:
    """LoRA and QLoRA, on DDP and on FSDP2, trained uninterrupted: the final adapter."""
    return request.param, references.start(f"mem-ref-{request.param}")


def _run_dir(cfg: Any) -> Path:
    return Path(cfg.storage.path) / cfg.run.name


def _steps(cfg: Any) -> list[dict[str, Any]]:
    loc = resolve(str(_run_dir(cfg))).join("metrics.jsonl")
    return [r for r in read_records(loc) if "step" in r and "loss" in r]


def _finish(client: Any, job_id: str) -> str:
    status, _ = follow(client, job_id, progress=False)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-5000:]
    return logs


def _attempts(cfg: Any) -> list[dict[str, Any]]:
    run = resolve(str(_run_dir(cfg)))
    return [r for r in journal.read(run) if r["event"] == "attempt"]


def _every_step_once(cfg: Any) -> None:
    _, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))


def _check_exact(cfg: Any, ref: Reference) -> None:
    _every_step_once(cfg)
    reference = ref.weights()
    got = _weights(_run_dir(cfg) / FINAL)
    assert got.keys() == reference.keys()
    for k, want in reference.items():
        assert torch.equal(got[k], want), k  # bit-identical, not merely close


def _sigkill_rank1_after_17(
    cluster: Any,
    tiny: Any,
    root: Path,
    name: str,
    drill: str = "RAYLIFT_FAULT_KILL_AFTER_STEP",
    **sections: Any,
) -> Any:
    """Runs a job whose rank 1 SIGKILLs itself after step 17 (between storage checkpoints
    10 and 20) to its end, and checks its one restart: the second attempt restored step 16
    or 17 from its node's keeper (memory-own), not storage's 10, losing at most one step.
    `drill`: the kill after the whole step, or right after its snapshot reached the
    keepers. Returns the job's config."""
    cfg, client, job_id = launch(
        cluster, memory_job(root, tiny, name, **sections), env={drill: "17"}
    )
    _finish(client, job_id)
    attempts = _attempts(cfg)
    assert len(attempts) == 2, attempts
    second = attempts[1]
    assert second["restored_from"] == "memory-own", second
    assert 16 <= second["from_step"] <= 17 and second["lost_steps"] <= 1, second
    return cfg


def _node(cluster: Any, **labels: str) -> Any:
    found = [
        n for n, lab in cluster.worker_nodes if all(lab.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, cluster.worker_nodes
    return found[0]


# The run's keepers registered on the cluster, listed by a driver of its own (see
# run_driver): waits up to `within` seconds for the list to empty, then prints the node
# ids still holding one.
KEEPERS = """
import json, sys, time
import ray
from trainer.checkpoint import memory

address, ns, within = sys.argv[1], sys.argv[2], float(sys.argv[3])
ray.init(address=address, namespace="memtier-test", log_to_driver=False, logging_level="WARNING")
deadline = time.monotonic() + within
while (left := memory.list_keepers(ns)) and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps(sorted(left)))
"""


def _keepers(cfg: Any, cluster: Any, within: float = 0.0) -> list[str]:
    """Node ids of the run's keepers still registered (after waiting up to `within` s
    for none to be left)."""
    from trainer.checkpoint import memory

    ns = memory.namespace(resolve(str(_run_dir(cfg))).uri, cfg.run.name)
    out = run_driver(cluster, KEEPERS, ns, within)
    return json.loads(out.strip().splitlines()[-1])


def _no_keepers_left(cfg: Any, cluster: Any) -> None:
    """The driver ended the run's keepers: none is listed in the run's namespace."""
    assert _keepers(cfg, cluster) == []


@pytest.mark.bench_only
def test_fsdp_worker_sigkill_restores_its_shards_from_memory_exactly(
    ray_cluster, tiny, tmp_path, fsdp_reference
):
    """FSDP2 (dcp/2): each rank's shard files travel like any checkpoint file. In make
    bench (issue 56), as is pp=2: CI's QLoRA on FSDP2 restores each rank's own shard files
    from the keepers."""
    cfg = _sigkill_rank1_after_17(
        ray_cluster, tiny, tmp_path, "mem-fsdp", strategy={"name": "fsdp"}
    )
    _check_exact(cfg, fsdp_reference)


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_pp_worker_sigkill_restores_from_memory_exactly(
    ray_cluster, tiny, tmp_path, layout_reference
):
    """pp=2 on two workers: each rank's dcp/2 files (its pipeline stage) are its share;
    after rank 1's SIGKILL both ranks restore them from their node keepers and the run ends
    with the uninterrupted layout's weights."""
    name, want = layout_reference
    strategy = {"name": "fsdp", **LAYOUTS[name]}
    cfg = _sigkill_rank1_after_17(ray_cluster, tiny, tmp_path, f"mem-{name}", strategy=strategy)
    _check_exact(cfg, want)


def test_adapter_worker_sigkill_restores_the_adapter_from_memory_exactly(
    ray_cluster, tiny, tmp_path, adapter_reference
):
    """LoRA and QLoRA, on DDP (rank 0 writes them) and on FSDP2 (each rank its shard of
    them): a snapshot holds only what trains (the adapters and their moments); after rank
    1's SIGKILL the run resumes from its node's keeper and ends with the uninterrupted
    run's adapter, bit for bit."""
    name, ref = adapter_reference
    sections = _adapter_sections(name)
    cfg = _sigkill_rank1_after_17(ray_cluster, tiny, tmp_path, f"mem-{name}", **sections)
    _every_step_once(cfg)
    want = ref.weights(adapter=True)
    got = load_file(str(_run_dir(cfg) / FINAL_ADAPTER))
    assert got.keys() == want.keys() and any("lora_" in k for k in got), list(got)
    for k, w in want.items():
        assert torch.equal(got[k], w), k  # bit-identical


# Four faults in one DDP run (issue 56: a Ray job's start-up is most of each case's time),
# each judged by a test of its own on the attempt that followed it: rank 1 SIGKILLed right
# after its step-7 snapshot reached the keepers, rank 1's node lost without grace (at step
# 13 or later), lost again while step 25's buddy copies are held, and both worker nodes
# lost while training is held after step 35.
KILLED_AT, LOST_AT, BUDDY_HELD, BOTH_LOST = 7, 13, 25, 35
PACE_S = 0.2
"""Each step takes at least this long (RAYLIFT_FAULT_MIN_STEP_S) until the last fault, so
a fault the test lands after step N comes well before the run passes the next one's step
however fast the machine; the last attempt runs at full speed."""


@pytest.fixture(scope="module")
def node_faults(ray_cluster, tiny, tmp_path_factory) -> dict[str, Any]:
    """Runs the four faults' job to its end; returns its config, its attempts, the attempt
    that followed each node fault (the first to begin after it) and the newest step seen
    before the first node loss."""
    root = tmp_path_factory.mktemp("mem-node")
    buddy, train, pace = root / "buddy.release", root / "train.release", root / "pace.release"
    cfg, client, job_id = launch(
        ray_cluster,
        memory_job(root, tiny, "mem-node"),
        env={
            "RAYLIFT_FAULT_KILL_AFTER_SNAPSHOT": str(KILLED_AT),
            "RAYLIFT_FAULT_HOLD_BUDDY": f"{BUDDY_HELD}:{buddy}",
            "RAYLIFT_FAULT_HOLD": f"{BOTH_LOST}:{train}",
            "RAYLIFT_FAULT_MIN_STEP_S": f"{PACE_S}:{pace}",
        },
    )
    kills: dict[str, float] = {}

    # 0. Rank 1 kills itself after step 7's snapshot (the drill); the group restarts.
    # 1. Rank 1's node (its raylet, its worker and its keeper) goes at once after step 13.
    wait_for(lambda: [r for r in _steps(cfg) if r["step"] >= LOST_AT], "step 13", client, job_id)
    seen = max(r["step"] for r in _steps(cfg))
    kills["lost"] = time.time()
    ray_cluster.kill_node(_node(ray_cluster, pool="cpu"))
    ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})

    # 2. The next attempt's step-25 snapshot is on each node's keeper, its buddy copies held.
    held = [buddy.with_name(f"{buddy.name}.buddy.r{r}") for r in (0, 1)]
    wait_for(lambda: all(p.exists() for p in held), "step 25's buddy copies held", client, job_id)
    kills["held"] = time.time()
    ray_cluster.kill_node(_node(ray_cluster, pool="cpu"))
    buddy.touch()  # the survivor's held copy goes on; its attempt is ending anyway
    ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})

    # 3. Training held after step 35 by the attempt that began after fault 2 (a group
    # that was ending may have touched the hold's files before: they must be newer).
    stopped = [train.with_name(f"{train.name}.train.r{r}") for r in (0, 1)]

    def both_held() -> bool:
        began = [a["began"] for a in _attempts(cfg) if a["began"] > kills["held"]]
        return bool(began) and all(p.exists() and p.stat().st_mtime > began[0] for p in stopped)

    wait_for(both_held, "training held after step 35", client, job_id)
    kills["both"] = time.time()
    ray_cluster.kill_node(_node(ray_cluster, pool="cpu"))
    ray_cluster.kill_node(_node(ray_cluster, large_cpu_mem="true"))
    pace.touch()
    train.touch()
    ray_cluster.add_node(num_cpus=1, labels={"large_cpu_mem": "true"})
    ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
    _finish(client, job_id)

    attempts = _attempts(cfg)
    after = {k: next(a for a in attempts if a["began"] > t) for k, t in kills.items()}
    return {"cfg": cfg, "attempts": attempts, "after": after, "seen": seen}


def test_worker_sigkill_loses_at_most_one_step_and_restores_from_its_node_keeper(
    node_faults, reference, ray_cluster
):
    """DDP: rank 0's model and optimizer, every rank's data position and RNG. The kill
    lands right after step 7's snapshot is on the keepers (node_faults' first fault): the
    restore from it must leave step 7's metrics record (one record per kept step; the
    snapshot used to be taken before the record was written, and the history skipped the
    step). Its one restart is the run's second attempt, and the next began after the node
    loss."""
    cfg, attempts = node_faults["cfg"], node_faults["attempts"]
    assert attempts.index(node_faults["after"]["lost"]) == 2, attempts
    second = attempts[1]
    assert second["restored_from"] == "memory-own", second
    assert KILLED_AT - 1 <= second["from_step"] <= KILLED_AT and second["lost_steps"] <= 1, second
    _check_exact(cfg, reference)
    _no_keepers_left(cfg, ray_cluster)


def test_node_lost_without_grace_loses_at_most_two_steps_and_restores_from_the_buddy(
    node_faults, reference
):
    """Rank 1's node (its raylet, its worker and its keeper) goes at once after step 13;
    rank 1's share survives only as the copy on rank 0's node, and the run resumes from
    it when a replacement node joins (node_faults' first fault)."""
    cfg, attempts, seen = node_faults["cfg"], node_faults["attempts"], node_faults["seen"]
    assert len(attempts) >= 2, attempts
    second = node_faults["after"]["lost"]
    assert second["restored_from"] == "memory-buddy", second
    assert second["from_step"] >= seen - 2 and second["lost_steps"] <= 2, (second, seen)
    assert second["from_step"] % EVERY != 0 or second["from_step"] > 10, second
    _check_exact(cfg, reference)


def test_node_and_buddy_both_lost_restores_from_storage(node_faults, reference):
    """Both worker nodes go (node_faults' third fault): no keeper holds a share, and the
    run resumes from storage's newest checkpoint."""
    cfg = node_faults["cfg"]
    second = node_faults["after"]["both"]
    assert second["restored_from"] == "storage", second
    assert second["from_step"] % EVERY == 0, second
    _check_exact(cfg, reference)


def test_a_kill_while_the_buddy_copy_is_held_restores_the_same_older_step_everywhere(
    node_faults, reference
):
    """Step 25's snapshot is on each node's keeper but its copies to the buddies are held
    when rank 1's node goes (node_faults' second fault): rank 1's step 25 is gone, so every
    rank restores step 24 (rank 0 from its own keeper, rank 1 from the buddy copy on rank
    0's node)."""
    cfg = node_faults["cfg"]
    second = node_faults["after"]["held"]
    assert second["from_step"] == BUDDY_HELD - 1, second
    assert second["restored_from"] == "memory-buddy", second
    _check_exact(cfg, reference)


# A driver of its own starts a keeper on each worker node, hands one a share, starts
# them again as a resubmitted driver would, and ends them; prints what it saw.
KEEPER_DRILL = """
import json, sys
import ray
from trainer.checkpoint import memory

address, ns = sys.argv[1], sys.argv[2]
ray.init(address=address, namespace="memtier-test", log_to_driver=False, logging_level="WARNING")
try:
    started = memory.start_keepers(ns)
    node = sorted(started)[0]
    files = {"strategy/model.pt": b"\\x01" * 300_000}
    ref = ray.put(files)
    stored = ray.get(started[node].put.remote(3, 0, 1, ref, {"strategy/model.pt": 300_000}))
    del ref
    again = memory.start_keepers(ns)  # a resubmitted driver reuses them
    inv = ray.get(again[node].inventory.remote())
    out = {
        "started": sorted(started),
        "stored": stored,
        "same_pid": ray.get(again[node].pid.remote()) == ray.get(started[node].pid.remote()),
        "shares": {str(s): {str(r): k for r, k in v.items()} for s, v in inv["shares"].items()},
        "nbytes": inv["nbytes"],
        "got_back": ray.get(again[node].get.remote(3, 0)) == files,
        "ended": memory.end_keepers(ns),
        "left": sorted(memory.list_keepers(ns)),
    }
finally:
    memory.end_keepers(ns)
print(json.dumps(out))
"""


def test_a_keeper_actor_holds_its_own_copy_and_the_driver_helpers_reuse_and_end_it(
    ray_cluster,
):
    from trainer.checkpoint import memory

    ns = memory.namespace("/tmp/runs/keeper-test", "keeper test")
    assert ns.startswith("raylift-mem-keeper-test-")
    out = json.loads(run_driver(ray_cluster, KEEPER_DRILL, ns).strip().splitlines()[-1])
    nodes = sorted(n.node_id for n, _ in ray_cluster.worker_nodes)
    assert out["started"] == nodes  # one per worker node, none on the CPU-less head
    assert out["stored"] and out["same_pid"] and out["got_back"], out
    assert out["shares"] == {"3": {"0": OWN}} and out["nbytes"] == 300_000, out
    assert out["ended"] == len(nodes) and out["left"] == [], out


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_raylift_stop_ends_the_keepers(ray_cluster, tiny, tmp_path):
    """A stopped run (Ray's job stop: SIGTERM to the driver, SIGKILL 3 s later) leaves no
    keeper holding a node's memory."""
    cfg, client, job_id = launch(ray_cluster, memory_job(tmp_path, tiny, "mem-stop"))
    try:
        wait_for(lambda: [r for r in _steps(cfg) if r["step"] >= 5], "step 5", client, job_id)
        assert len(_keepers(cfg, ray_cluster)) == 2  # one per worker node
    finally:
        client.stop_job(job_id)
    deadline = time.monotonic() + 120
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert str(client.get_job_status(job_id)) in ("STOPPED", "JobStatus.STOPPED")
    assert _keepers(cfg, ray_cluster, within=60) == []
