"""Goodput: where every paid accelerator-second of a run went.

Paid time is wall time × workers, from the driver's start to the run's last record. It is
split, from the run's metrics file and journal alone, into:

- `waiting`: waiting for workers: capacity, and the driver's own preparation before it
  asks for them (from the driver's start, or a failure, to the moment a worker group's
  processes began),
- `startup`: start-up (image, model load, tokenizing, the process group) before training,
- `restore`: reading the checkpoint or snapshot an attempt resumed from,
- `kept`: steps that are part of the final model,
- `lost/<cause>`: steps trained and then thrown away by a fault, plus the time from the
  last step to the failure (`worker kill`, `node loss`, `drained notice`, `driver loss`),
- `ckpt/storage` and `ckpt/memory`: the checkpoint stalls of each tier, and where the
  run's cadence measured it (`auto` intervals: trainer.planner.cadence), the step time
  each save's write in flight added to the steps after it (its inflation, taken from
  those steps: a snapshot per metrics record that stalled for one, a storage checkpoint
  per step the journal records one of),
- `eval`: evaluation,
- `tail`: the idle tail after the last step (export, probe, shutdown).

Runtime goodput is kept ÷ paid; program goodput is the model FLOPs utilisation of the kept
steps. Given the run's bill, each part gets its share of the dollars. The parts partition
the timeline, so they add up to the paid time (to rounding).

Pure Python: `raylift report`, `status` and the demo read it; so does the bench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PARTS = (
    "waiting",
    "startup",
    "restore",
    "kept",
    "lost/worker kill",
    "lost/node loss",
    "lost/drained notice",
    "lost/driver loss",
    "lost/other",
    "ckpt/storage",
    "ckpt/memory",
    "eval",
    "tail",
)
LABELS = {
    "waiting": "waiting for workers",
    "startup": "start-up",
    "restore": "restore",
    "kept": "steps kept",
    "lost/worker kill": "retrained: worker kill",
    "lost/node loss": "retrained: node loss",
    "lost/drained notice": "retrained: drained notice",
    "lost/driver loss": "retrained: driver loss",
    "lost/other": "retrained: other fault",
    "ckpt/storage": "checkpoints (storage)",
    "ckpt/memory": "checkpoints (RAM tier)",
    "eval": "evaluation",
    "tail": "idle tail",
}
_CAUSE = {
    "worker_died": "lost/worker kill",
    "worker_kill": "lost/worker kill",
    "node_lost": "lost/node loss",
    "preempted": "lost/drained notice",
    "drained": "lost/drained notice",
    "driver_lost": "lost/driver loss",
}
_STEP_PHASES = ("data", "fwd_bwd", "optim")


@dataclass
class Goodput:
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    """Accelerator-seconds (seconds × workers) per part."""
    paid: float = 0.0
    program: float | None = None
    """Mean MFU of the kept steps."""
    usd_total: float | None = None

    @property
    def runtime(self) -> float | None:
        return self.parts["kept"] / self.paid if self.paid > 0 else None

    @property
    def accounted(self) -> float:
        return sum(self.parts.values())

    def usd(self, part: str) -> float | None:
        if self.usd_total is None or self.paid <= 0:
            return None
        return self.usd_total * self.parts[part] / self.paid

    def to_dict(self) -> dict[str, Any]:
        return {
            "paid_s": self.paid,
            "parts_s": dict(self.parts),
            "runtime_goodput": self.runtime,
            "program_goodput": self.program,
            "usd_total": self.usd_total,
        }


def _add(g: Goodput, part: str, seconds: float, workers: int) -> None:
    g.parts[part] += max(0.0, seconds) * workers


def _failure_cause(journal: list[dict[str, Any]], after: float, before: float) -> str:
    """The part a failure between two attempts is charged to: the controller's cause, else
    a spot notice the loop saw (drained), else a new driver (the old one was lost)."""
    window = [r for r in journal if after <= float(r.get("time", 0)) <= before]
    for event in ("failure", "preemption", "driver"):
        for r in window:
            if r.get("event") == event:
                if event == "failure":
                    return _CAUSE.get(str(r.get("cause")), "lost/other")
                return "lost/drained notice" if event == "preemption" else "lost/driver loss"
    return "lost/other"


def measure(
    records: list[dict[str, Any]],
    journal: list[dict[str, Any]],
    usd_total: float | None = None,
    end_time: float | None = None,
) -> Goodput:
    """The split of a run's paid time (see the module). `records`: its metrics file;
    `journal`: its journal records (trainer.resilience.journal.read)."""
    g = Goodput(usd_total=usd_total)
    train = [
        r for r in records if r.get("event", "train") == "train" and "step" in r and "time" in r
    ]
    attempts = [r for r in journal if r.get("event") == "attempt" and "time" in r]
    if not train or not attempts:
        return g
    drivers = [float(r["time"]) for r in journal if r.get("event") == "driver"]
    starts = {int(r["attempt"]): r for r in records if r.get("event") == "start"}
    # The resume point of every later attempt decides which steps are kept.
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for r in train:
        by_attempt.setdefault(int(r.get("attempt", 1)), []).append(r)
    numbers = sorted(by_attempt)
    # journal attempts in time order, matched to the metrics file's attempts in order
    attempts = sorted(attempts, key=lambda r: float(r["time"]))[-len(numbers) :]
    resume_points = [int(a.get("from_step", 0)) for a in attempts]
    mfus: list[float] = []
    prev_end = min(drivers) if drivers else None
    for i, num in enumerate(numbers):
        rows = sorted(by_attempt[num], key=lambda r: int(r["step"]))
        att = attempts[i]
        workers = int(att.get("world_size") or starts.get(num, {}).get("world_size") or 1)
        att_time = float(att["time"])
        began = float(att.get("began") or att_time)
        if prev_end is None:
            prev_end = min(began, att_time)
        cause = "lost/other"
        if i:  # the failure between the previous attempt's start and this one
            cause = _failure_cause(journal, float(attempts[i - 1]["time"]), att_time)
        _add(g, "waiting", began - prev_end, workers)
        restore_s = float(att.get("restore_s") or 0.0)
        _add(g, "startup", att_time - began - restore_s, workers)
        _add(g, "restore", min(restore_s, max(0.0, att_time - began)), workers)
        if i:  # what the previous attempt lost: charged to its failure's cause
            g.parts[cause] += g.parts.pop("_pending", 0.0)
        kept_upto = min(resume_points[i + 1 :], default=None)
        last_step, last_time = int(att.get("from_step", 0)), att_time
        inflation = _inflation(journal, att.get("source"))
        owed = dict.fromkeys(inflation, 0.0)  # inflation still to take from later steps
        stored = {
            int(r["step"])
            for r in journal
            if r.get("event") == "checkpoint" and r.get("source") == att.get("source")
        }
        for r in rows:
            step, t = int(r["step"]), float(r["time"])
            n = max(1, step - last_step)
            span = max(0.0, t - last_time)
            per = {
                "ckpt/storage": n * float(r.get("t_ckpt_s_mean", 0.0) or 0.0),
                "ckpt/memory": n * float(r.get("t_snap_s_mean", 0.0) or 0.0),
                "eval": n * float(r.get("t_eval_s_mean", 0.0) or 0.0),
            }
            work = n * sum(float(r.get(f"t_{p}_s_mean", 0.0) or 0.0) for p in _STEP_PHASES)
            if r is rows[0] and work + sum(per.values()) < span:
                # before the first step: what start-up was left after the journal's record
                _add(g, "startup", span - work - sum(per.values()), workers)
                span = work + sum(per.values())
            overhead = sum(per.values())
            if overhead > span:  # clocks of different ranks: scale into the window
                per = {k: v * span / overhead for k, v in per.items()}
                overhead = span
            for k, v in per.items():
                _add(g, k, v, workers)
            steps_s = span - overhead
            for part in inflation:  # the saves before these steps slowed them
                take = min(owed[part], steps_s)
                steps_s -= take
                owed[part] -= take
                _add(g, part, take, workers)
            if inflation and per["ckpt/memory"] > 0:  # this record's step snapshotted
                owed["ckpt/memory"] += inflation["ckpt/memory"]
            if inflation and step in stored:  # a storage checkpoint of this step
                owed["ckpt/storage"] += inflation["ckpt/storage"]
            kept_n = n if kept_upto is None else max(0, min(step, kept_upto) - last_step)
            _add(g, "kept", steps_s * kept_n / n, workers)
            g.parts.setdefault("_pending", 0.0)
            g.parts["_pending"] += steps_s * (n - kept_n) / n * workers
            if kept_n and r.get("mfu") is not None:
                mfus.append(float(r["mfu"]))
            last_step, last_time = step, t
        if i + 1 < len(numbers):
            nxt = attempts[i + 1]
            nxt_began = float(nxt.get("began") or nxt["time"])
            failed_at = _failure_time(journal, last_time, nxt_began)
            g.parts["_pending"] += max(0.0, failed_at - last_time) * workers
            prev_end = failed_at
        else:
            end = end_time if end_time is not None else _end_time(journal, last_time)
            _add(g, "tail", end - last_time, workers)
    g.parts.pop("_pending", None)
    g.paid = sum(g.parts.values())
    g.program = sum(mfus) / len(mfus) if mfus else None
    return g


def _inflation(journal: list[dict[str, Any]], source: Any) -> dict[str, float]:
    """The step time one save of each tier added while its write was in flight, as the
    attempt's cadence last measured it (its journaled decisions' costs); none where the
    attempt had no cadence (intervals set by number)."""
    costs = [
        r.get("costs") or {}
        for r in journal
        if r.get("event") == "cadence" and source is not None and r.get("source") == source
    ]
    if not costs:
        return {}
    last = costs[-1]
    return {
        "ckpt/memory": float(last.get("memory_inflation_s") or 0.0),
        "ckpt/storage": float(last.get("storage_inflation_s") or 0.0),
    }


def _failure_time(journal: list[dict[str, Any]], after: float, before: float) -> float:
    """When the failure after `after` was seen (the controller's record), else `after`."""
    for r in journal:
        t = float(r.get("time", 0))
        if r.get("event") == "failure" and after <= t <= before:
            return t
    return after


def _end_time(journal: list[dict[str, Any]], last: float) -> float:
    ends = [float(r["time"]) for r in journal if r.get("event") in ("finished", "stopped")]
    return max([last, *ends])


def lines(g: Goodput) -> list[str]:
    """The split as report lines."""
    if g.paid <= 0:
        return []
    out = [
        f"goodput: runtime {g.runtime:.1%} of {g.paid / 3600:.3f} paid accelerator-hours"
        + (f", program (MFU) {g.program:.1%}" if g.program is not None else "")
    ]
    parts = [
        f"{LABELS[p]} {v / g.paid:.1%}" + (f" ${g.usd(p):,.2f}" if g.usd(p) is not None else "")
        for p, v in g.parts.items()
        if v > 0
    ]
    out.append("goodput split: " + ", ".join(parts))
    if g.usd_total is None:
        out.append("goodput: no dollars per part (no node prices for this run)")
    return out
