"""The checkpoint cadence on a real Ray cluster on 127.0.0.1, under a fault schedule: one run
of the tiny Llama on two workers with `every_steps: auto` and `memory_every: auto` meets,
in order,

1. a worker SIGKILLed after step 15 (the fault drill),
2. the node of rank 1 lost without grace (its raylet and workers killed; a replacement
   joins) as soon as the next attempt has decided its intervals: the second fault within
   BURST_S, a burst,
3. a drained spot notice (the node agent, against a local metadata service, drains the
   replacement node; the loop checkpoints at once; the node goes and another joins),
4. a storage slowdown from the next attempt's start (every upload pauses SLOW_S more) and
   a rebalance recommendation from the same metadata service,

and then trains to its end. The journal's cadence decisions must move the way the rule
says: every decision is the rule's for its journaled inputs; the burst shortens the RAM
tier's interval (in seconds of training, against the attempt before the node loss); the
slow storage lengthens the storage interval (the write floor); the rebalance reaches the
loop on every rank and is journaled. Goodput's parts add up to wall time × workers within
1 %. The simulator's replay of the same schedule (trainer.planner.faults_replay: each
attempt's measured costs, the step and cause that ended it, its restart) predicts the
lost steps and the runtime goodput within 10 %.

The rates are set for a drill (checkpoint.failure_rate_per_hour: 2 an hour, so two faults
make a burst) and the wall-time cap is 4 s (checkpoint.max_interval_s), so the intervals
the rule picks are seconds, not hours: each move shows within the run. The cap is that short
for the write floor: a restarted attempt starts from the run's journaled costs (no
measuring save at its start), so the slow attempt's first upload starts one storage
interval in and lands SLOW_S later, and the floor shows only if that is well inside the
attempt's ~1100 steps (18 s on a quiet VM).

The schedule is judged in journal records, not seconds: each fault waits for the record
before it (a restart, a decision, the drained notice), and the run is kept from finishing
before the write floor shows. Every step takes at least MIN_STEP_S
(RAYLIFT_FAULT_MIN_STEP_S) until the test has seen the floor's decision, then the run
finishes at full speed; a fast machine (a quiet one ran the whole job before the floor,
4 times in 4) trains as a loaded one would, a loaded one is not slowed at all.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.imds import FakeImds, node_agent
from tests.support.jobs import base_job
from tests.support.ray_jobs import history, launch, wait_for
from tools.jobcli.follow import follow
from trainer import faults
from trainer.observability import goodput
from trainer.observability.metrics import lineage
from trainer.planner.cadence import Costs, Rates, decide, prior_rates
from trainer.planner.faults_replay import Attempt, replay
from trainer.resilience import journal
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow

STEPS = 1200
KILL_AT = 15
RATE = 2.0  # hard failures an hour (checkpoint.failure_rate_per_hour)
CAP_S = 4.0  # checkpoint.max_interval_s
SLOW_S = 6.0  # the storage slowdown: seconds more per upload (the floor: 2 intervals)
MIN_STEP_S = 0.03  # each step at least this long until the floor shows (~27 s for the last
# attempt's ~900 steps, against the ~11 s the floor needs: one interval, then SLOW_S)
WORKERS = 2
STALLS = ("ckpt", "snap", "eval")


def _job(tiny: dict[str, Path], root: Path) -> Path:
    data = base_job(tiny, root / "runs", "cadence-faults")
    data["train"].update({"max_steps": STEPS, "eval_every": None, "log_every": 1})
    data["checkpoint"] = {
        "every_steps": "auto",
        "memory_every": "auto",
        "keep_last": 2,
        "failure_rate_per_hour": RATE,
        "max_interval_s": CAP_S,
    }
    data["run"].update({"max_failures": 5})
    path = root / "cadence-faults.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plain_node(cluster: Any) -> Any:
    nodes = [n for n, labels in cluster.worker_nodes if labels.get("pool") == "cpu"]
    assert len(nodes) == 1, cluster.worker_nodes
    return nodes[0]


class Run:
    """The run's journal, read again at each question."""

    def __init__(self, run: Any):
        self.run = run

    def records(self) -> list[dict[str, Any]]:
        return journal.read(self.run)

    def attempts(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["event"] == "attempt"]

    def decided(self, after: float = 0.0, **match: Any) -> Any:
        """A predicate: the cadence decisions past measuring journaled after `after` (Unix
        time) that match `match`, in time order."""

        def pred() -> list[dict[str, Any]]:
            return [
                d
                for d in self.records()
                if d["event"] == "cadence"
                and d["time"] > after
                and "measuring" not in d["reasons"].values()
                and all(d.get(k) == v for k, v in match.items())
            ]

        return pred


def _seconds(d: dict[str, Any], tier: str) -> float:
    """A decision's interval of `tier` in seconds of training, as the rule gives it for the
    decision's journaled inputs (the agreed steps carry the ranks' step-time noise)."""
    return getattr(_rule(d), f"{tier}_every") * d["costs"]["step_s"]


def _rule(d: dict[str, Any]) -> Any:
    """What the rule gives for a journaled decision's own inputs."""
    return decide(
        Costs(**d["costs"]),
        Rates(**d["rates_per_hour"]),
        memory_tier=True,
        max_overhead=d["max_overhead"],
        max_interval_s=d["max_interval_s"],
        burst=d["burst"],
    )


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_cadence_moves_with_a_fault_schedule_and_the_replay_predicts_it(
    ray_cluster, tiny, tmp_path
):
    started = time.monotonic()
    slow = tmp_path / "slow-storage"
    notice = tmp_path / "rebalance.json"
    floor_seen = tmp_path / "floor-seen"  # ends the steps' minimum time
    env = {
        # the kill waits for the saves in flight: whether the step-5 ones survive it is not
        # a race between a loaded machine's write and ten steps (the replay is told so)
        faults.KILL_AFTER_STEP_ENV: f"{KILL_AT}:settled",
        faults.SLOW_STORAGE_ENV: f"{slow}:{SLOW_S}",
        faults.MIN_STEP_ENV: f"{MIN_STEP_S}:{floor_seen}",
        "RAYLIFT_REBALANCE_FILE": str(notice),
    }
    cfg, client, job_id = launch(ray_cluster, _job(tiny, tmp_path), env=env)
    run = Run(resolve(str(Path(cfg.storage.path) / cfg.run.name)))

    # 1. the drill's kill after step 15; 2. rank 1's node lost once the next attempt has
    # decided its intervals (before its first periodic snapshot), and a replacement joins.
    first = wait_for(
        lambda: [a for a in run.attempts() if a["after"] == "failure"], "a restart", client, job_id
    )[0]
    wait_for(run.decided(after=first["time"]), "the next intervals", client, job_id)
    node_lost = time.time()
    ray_cluster.kill_node(_plain_node(ray_cluster))
    ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
    victim = _plain_node(ray_cluster)
    with (
        FakeImds() as imds,
        node_agent(
            imds,
            victim.node_id,
            ray_cluster.address,
            tmp_path / "agent.log",
            RAYLIFT_REBALANCE_FILE=str(notice),
        ),
    ):
        # 3. a spot notice once the attempt after the node loss (a burst) has decided
        wait_for(run.decided(after=node_lost, burst=True), "the burst", client, job_id)
        imds.trigger_spot(20)  # the agent drains with 10 s left
        drained = wait_for(
            lambda: [r for r in run.records() if r["event"] == "preemption"],
            "the emergency checkpoint",
            client,
            job_id,
        )[0]
        slow.touch()  # 4. storage is slow from the next attempt on
        ray_cluster.kill_node(victim)  # the reclaim
        ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
        wait_for(run.decided(after=drained["time"]), "the last attempt", client, job_id)
        imds.trigger_rebalance()
        wait_for(
            lambda: [r for r in run.records() if r["event"] == "rebalance"],
            "the rebalance recommendation in the loop",
            client,
            job_id,
        )[0]
        wait_for(
            lambda: [
                d
                for d in run.decided(after=drained["time"])()
                if d["reasons"]["storage"] == "write"
            ],
            "the write floor under slow storage",
            client,
            job_id,
        )
        floor_seen.touch()  # the rest of the run at full speed
        slow.unlink()
    status, _ = follow(client, job_id, progress=False)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-4000:]

    records, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # every step once
    lost, replayed, g = judge(run, records, node_lost)
    print(
        f"cadence faults: {time.monotonic() - started:.0f} s; lost {lost} steps (replay "
        f"{replayed.lost_steps}); runtime goodput {g.runtime:.3f} (replay {replayed.goodput:.3f})"
    )


def judge(run: Run, records: list[dict[str, Any]], node_lost: float) -> tuple[int, Any, Any]:
    """Everything the test asserts after the run, from its metrics and journal alone (so a
    finished run's files can be judged again)."""
    jrecords = run.records()
    drained = next(r for r in jrecords if r["event"] == "preemption")
    rebalance = next(r for r in jrecords if r["event"] == "rebalance")
    attempts = run.attempts()
    assert {a["world_size"] for a in attempts} == {WORKERS}, attempts
    after_drain = [a for a in attempts if a["time"] > drained["time"]]
    assert after_drain and all(a["lost_steps"] == 0 for a in after_drain), attempts
    assert all(a["from_step"] == drained["step"] for a in after_drain), (attempts, drained)
    assert rebalance["shortened"] is True and rebalance["ranks"] >= 1, rebalance

    # The intervals move as the rule says. Every decision is the rule's for its journaled
    # inputs: the same reasons (the steps themselves are the ranks' mean of proposals made
    # at the step's start, each with its own step time: on the loaded VM up to 2.7 times
    # the rule's for rank 0's costs a step later, so the moves below are judged in the
    # rule's seconds).
    for d in run.decided()():
        assert _rule(d).reasons == d["reasons"], d
    calm = [d for d in run.decided(burst=False)() if d["time"] < node_lost][-1]
    burst = run.decided(after=node_lost, burst=True)()[0]
    assert burst["why"] == "fault burst", burst
    # Two faults within BURST_S: the rates count BURST_FACTOR times higher, so where
    # Young/Daly sets the RAM tier's interval it halves against what the rule gives the
    # same measured costs outside a burst (the guards never lengthen it). Not against the
    # calm attempt's interval: the costs move between attempts too, and on the loaded VM a
    # snapshot measured 4 times dearer after the node loss cancelled the halving once.
    unburst = {**burst, "burst": False}
    assert _seconds(burst, "memory") <= _seconds(unburst, "memory"), (calm, burst)
    rule = ("young", "daly")  # where the cap binds the calm interval, halving may not show
    if burst["reasons"]["memory"] in rule and _rule(unburst).reasons["memory"] in rule:
        assert _seconds(burst, "memory") < 0.75 * _seconds(unburst, "memory"), (calm, burst)
    # Slow storage: the write floor lengthens the storage interval past what it was.
    last = run.decided(after=drained["time"])()
    floor = next(d for d in last if d["reasons"]["storage"] == "write")
    before = [d for d in last if d["time"] < floor["time"]]
    assert before and before[-1]["reasons"]["storage"] != "write", last
    # The first floor comes as soon as the measured write passes the interval it had, so it
    # is longer, by however much the write measured then (4.03 -> 4.06 s on one CI run).
    assert _seconds(floor, "storage") > _seconds(before[-1], "storage"), last
    assert _seconds(floor, "storage") >= 0.9 * floor["costs"]["storage_write_s"], floor

    # Goodput's parts add up to the wall time × workers.
    g = goodput.measure(records, jrecords)
    began = min(float(r["time"]) for r in jrecords if r["event"] == "driver")
    ended = max(float(r["time"]) for r in jrecords if r["event"] == "finished")
    wall = ended - began
    assert abs(g.paid - wall * WORKERS) <= 0.01 * wall * WORKERS, (g.to_dict(), wall)

    # The simulator replaying the schedule predicts the lost steps and the goodput.
    replayed, lost = _replay(records, jrecords, began, ended)
    resumed = [a["from_step"] for a in attempts[1:]]
    assert lost > 0 and abs(replayed.lost_steps - lost) <= 0.10 * lost, (replayed, resumed)
    assert g.runtime is not None and 0 < replayed.goodput < 1, (replayed, g.to_dict())
    assert abs(replayed.goodput - g.runtime) <= 0.10 * g.runtime, (replayed, g.to_dict())
    # Under slow storage a due checkpoint waited for the upload in flight, training on
    # (it used to stall the step for the upload slot: 14-18 s the replay did not see).
    assert any(d["deferred"]["storage"] > 0 for d in last), last
    return lost, replayed, g


def _replay(
    records: list[dict[str, Any]], jrecords: list[dict[str, Any]], began: float, ended: float
) -> tuple[Any, int]:
    """The run's schedule as the replay takes it, replayed; and the steps the run lost (its
    metrics' lineage: trained, then thrown away by a resume)."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("event", "train") == "train" and "step" in r and "loss" in r:
            rows.setdefault(int(r["attempt"]), []).append(r)
    every = sorted((r for r in jrecords if r["event"] == "attempt"), key=lambda r: r["time"])
    starts = sorted(int(r["attempt"]) for r in records if r.get("event") == "start")
    assert len(starts) == len(every), (starts, every)
    # an attempt that failed before its first step is part of the next one's restart
    numbers = [n for n in starts if n in rows]
    att = [a for n, a in zip(starts, every, strict=True) if n in rows]
    trips = [r["costs"]["memory_write_s"] for r in jrecords if r["event"] == "cadence"]
    trip = statistics.median([t for t in trips if t > 0] or [0.0])
    per: list[Attempt] = []
    firsts, lasts, step_s = [], [], []
    for num in numbers:
        mine = sorted(rows[num], key=lambda r: int(r["step"]))
        # a step's wall time less its checkpoint, snapshot and eval phases (what goodput
        # counts as the step's work; the replay adds the stalls and waits itself)
        gaps = [
            b["time"] - a["time"] - sum(float(b.get(f"t_{p}_s_mean") or 0) for p in STALLS)
            for a, b in itertools.pairwise(mine)
        ]
        step_s.append(statistics.fmean(gaps))
        firsts.append(mine[0]["time"])
        lasts.append(mine[-1])
    for i in range(len(numbers)):
        src = att[i]["source"]
        costs = [r["costs"] for r in jrecords if r["event"] == "cadence" and r["source"] == src]
        last = costs[-1]
        # each periodic checkpoint's own write and upload (the slowdown came and went; the
        # final and emergency ones are in the tail and the restart); past the last one
        # measured, the storage as it was when not slowed (the attempt's fastest)
        writes = [
            float(r.get("write_wait_s") or 0) + float(r.get("upload_s") or 0)
            for r in jrecords
            if r["event"] == "checkpoint" and r["source"] == src and r["kind"] == "periodic"
        ]
        a = Attempt(
            step_s=step_s[i],
            memory_stall_s=last["memory_stall_s"],
            storage_stall_s=last["storage_stall_s"],
            # a snapshot's trip, once measured (an attempt that ended before its first
            # trip was measured: the run's typical one)
            memory_write_s=max(c["memory_write_s"] for c in costs) or trip,
            memory_inflation_s=last.get("memory_inflation_s", 0.0),
            storage_inflation_s=last.get("storage_inflation_s", 0.0),
            storage_write_s=min(writes, default=last["storage_write_s"]),
            storage_writes=writes,
        )
        if i + 1 < len(numbers):
            a.end_step = int(lasts[i]["step"])
            a.cause = _cause(jrecords, att[i]["time"], att[i + 1]["time"])
            a.restart_s = firsts[i + 1] - lasts[i]["time"] - step_s[i + 1]
            # the drill's kill (the first fault) came once the saves in flight had landed;
            # on one CI run the replay took the step-5 snapshot's write as the run's median
            # trip (2 s under load) and had it land after the kill ten steps later
            a.settled = i == 0
        per.append(a)
    got = replay(
        per,
        steps=STEPS,
        rates=prior_rates(WORKERS, 1, None, hard_per_hour=RATE),
        memory_tier=True,
        max_overhead=0.02,
        max_interval_s=CAP_S,
        start_s=firsts[0] - began - step_s[0],
        tail_s=ended - lasts[-1]["time"],
    )
    return got, lineage(records)[1]


def _cause(jrecords: list[dict[str, Any]], after: float, before: float) -> str:
    window = [r for r in jrecords if after <= r["time"] <= before]
    if any(r["event"] == "preemption" for r in window):
        return "preempted"
    causes = [r["cause"] for r in window if r["event"] == "failure"]
    return causes[0] if causes else "worker_died"
