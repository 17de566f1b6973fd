"""A rebalance recommendation reaches the running job (trainer.resilience.rebalance): the
node agent writes the metadata service's notice for its node's ranks, the ranks flag it in
the step's all-reduce, and every rank's cadence shortens at the same step, journaled. No
Ray: the ranks here are two watches and the sum is the all-reduce's."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from tests.support.imds import FakeImds
from trainer.planner import cadence as cad
from trainer.planner.cadence import Cadence, Rates
from trainer.resilience import agent, journal
from trainer.resilience.preemption import PreemptionWatch
from trainer.resilience.rebalance import WHY, RebalanceWatch, read_notice, write_notice
from trainer.storage.location import resolve


def _cadence(log: list[dict]) -> Cadence:
    c = Cadence(
        Rates(memory=2.0, storage=0.05),
        memory_tier=True,
        max_overhead=0.05,
        journal=lambda event, **f: log.append({"event": event, **f}),
    )
    for _ in range(3):
        c.step_time(1.0)
    c.saved(cad.RAM, 0.05)
    c.saved(cad.STORAGE, 2.0)
    c.decide_alone()
    return c


def test_the_agents_notice_shortens_every_ranks_cadence(tmp_path) -> None:
    notice = tmp_path / "node-a" / "rebalance.json"  # rank 0's node; rank 1's has none
    notice.parent.mkdir()
    run = resolve(str(tmp_path / "run"))
    rt0 = SimpleNamespace(rank=0, journal=journal.Journal(run, "attempt-1-rank0"))
    rt1 = SimpleNamespace(rank=1, journal=None)
    logs: list[list[dict]] = [[], []]
    cadences = [_cadence(logs[0]), _cadence(logs[1])]
    calm = [(c.decision.memory_every, c.decision.storage_every) for c in cadences]
    watches = [
        RebalanceWatch(rt0, cadences[0], path=notice),
        RebalanceWatch(rt1, cadences[1], path=tmp_path / "node-b" / "rebalance.json"),
    ]
    assert sum(w.ask() for w in watches) == 0  # nothing yet: nothing moves
    with FakeImds() as imds:
        options = agent.AgentOptions(imds.endpoint, interval_s=0.1, rebalance_file=str(notice))
        node_agent = agent.Agent(options)
        node_agent.poll_once()
        assert not notice.exists()
        sent = imds.trigger_rebalance()
        node_agent.poll_once()
    assert read_notice(notice) == sent.replace(microsecond=0).timestamp()
    summed = sum(w.ask() for w in watches)  # the step's all-reduce
    assert summed == 1
    for w in watches:
        w.agreed(summed, done=17)
    for c, log in zip(cadences, logs, strict=True):
        assert c.burst
        for _ in range(2):  # the next step's proposals carry the burst; agreed on it
            c.decide_alone()
        assert log[-1]["why"] == WHY and log[-1]["burst"] is True
    shortened = [(c.decision.memory_every, c.decision.storage_every) for c in cadences]
    assert shortened[0] == shortened[1]  # every rank the same intervals
    assert shortened[0][0] < calm[0][0] and shortened[0][1] < calm[0][1]
    records = [r for r in journal.read(run) if r["event"] == "rebalance"]
    assert [(r["step"], r["ranks"], r["shortened"]) for r in records] == [(17, 1, True)]
    # flagged once: the same notice, asked again (or written again), is not a new one
    assert sum(w.ask() for w in watches) == 0
    write_notice(notice.read_text(), notice)
    assert sum(w.ask() for w in watches) == 0


def test_a_stale_notice_or_none_moves_nothing(tmp_path) -> None:
    notice = tmp_path / "rebalance.json"
    old = time.time() - cad.BURST_S - 60
    notice.write_text(
        json.dumps({"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(old))})
    )
    log: list[dict] = []
    c = _cadence(log)
    w = RebalanceWatch(SimpleNamespace(rank=0, journal=None), c, path=notice)
    assert w.ask() == 0 and not c.burst
    # a notice that does not parse counts from when it was written: fresh
    notice.write_text("not json")
    assert w.ask() == 1


def test_the_preemption_watch_carries_the_flag(tmp_path) -> None:
    """The loop's side: the flag rides the preemption watch's flags, and `check` acts on
    the summed value before asking Ray anything."""
    notice = tmp_path / "rebalance.json"
    write_notice(
        json.dumps({"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), notice
    )
    log: list[dict] = []
    c = _cadence(log)
    rt = SimpleNamespace(rank=0, journal=None, preemption=lambda: None)
    watch = PreemptionWatch(rt, enabled=True, cadence=c)
    watch.rebalance.path = notice
    asked, rebalanced = watch.ask()
    assert rebalanced == 1.0
    watch.check(asked, rebalanced, done=5)
    assert c.burst and watch.notice is None
    disabled = PreemptionWatch(rt, enabled=False, cadence=_cadence([]))
    disabled.rebalance.path = notice
    assert disabled.ask()[1] == 0.0
