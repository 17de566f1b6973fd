"""What RL users watch: an RL step's throughput counts the tokens it really ran (the
rollout's prompts and completions, the update's forward and backward), not global batch x
block size; MFU follows the update's tokens; the sampled completions go to the trackers'
tables at the step and stay out of the metrics record."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.unit.rl.test_rollout_feed import _feed, _job, _train_step
from trainer.objectives.base import TABLES, UPDATE_TOKENS
from trainer.observability.steps import StepReport
from trainer.observability.tracking.trackers import NullTracker


class _Tables(NullTracker):
    """A tracker that keeps what it was handed (the real backends: test_tracking_tables)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.tables: list[tuple[str, int, list[dict[str, Any]]]] = []

    def metrics(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        self.tables.append((name, step, rows))


def test_an_rl_step_reports_its_real_tokens_and_its_completions(tiny, tmp_path) -> None:
    cfg = _job(tiny, tmp_path)
    strategy, objective, feed = _feed(cfg, tiny, tmp_path)
    micro = feed.micro_batches(0)
    _train_step(strategy, objective, micro)
    metrics = objective.metrics(lambda values: values)
    real = float(sum(m[1].sum() for m in micro))  # prompt + completion tokens, no padding
    completions = float(sum(m[2].sum() for m in micro))
    assert metrics[UPDATE_TOKENS] == real
    assert metrics["tokens/rollout"] == real  # one update over the rollout it sampled
    assert completions < real < cfg.tokens_per_step  # 8 completions of <= 8 tokens, not 8 x 64
    rows = metrics[TABLES]["completions"]
    assert len(rows) == 4 and {r["step"] for r in rows} == {1}
    weights = {"length_target": 1.0, "math_answer": 0.5, "format_regex": 1.0}
    for r in rows:
        assert r["prompt"].startswith("what is") and isinstance(r["completion"], str)
        total = sum(w * r[f"reward/{k}"] for k, w in weights.items())
        assert r["reward"] == pytest.approx(total)

    # The step report: tokens_per_s and MFU from those tokens over the step's window.
    tracker = _Tables()
    rt = SimpleNamespace(rank=0, world_size=2, uploads_in_flight=lambda: 0)
    n_params, peak = 1_000_000, 1e12
    report = StepReport(
        rt=rt,
        log_every=1,
        steps=3,
        steps_per_epoch=3,
        n_params=n_params,
        peak=peak,
        all_reduce=lambda values: [values[0] * 2, values[1], values[2]],
        metrics_file=None,
        tracker=tracker,
        stats=None,
    )
    report.count(cfg.tokens_per_step)  # what the loop counts for every objective
    report.window_start = ws = time.perf_counter() - 2.0  # the window began 2 s ago
    before = time.perf_counter()
    record = report.report(0, 0.5, 1e-5, 1.0, ws, 512, lambda: dict(metrics))
    after = time.perf_counter()
    tps = record["tokens_per_s"]
    assert real / (after - ws) <= tps <= real / (before - ws)
    assert record["mfu"] == pytest.approx(6.0 * n_params * tps / 2 / peak)
    assert TABLES not in record and tracker.records == [record]
    assert tracker.tables == [("completions", 1, rows)]


def test_an_sft_record_keeps_the_loops_count() -> None:
    rt = SimpleNamespace(rank=0, world_size=1, uploads_in_flight=lambda: 0)
    report = StepReport(
        rt=rt,
        log_every=1,
        steps=1,
        steps_per_epoch=1,
        n_params=10,
        peak=None,
        all_reduce=lambda values: values,
        metrics_file=None,
        tracker=_Tables(),
        stats=None,
    )
    report.count(4096)
    report.window_start = ws = time.perf_counter() - 1.0
    before = time.perf_counter()
    record = report.report(0, 1.0, 1e-5, 1.0, ws, 4096, dict)
    after = time.perf_counter()
    assert 4096 / (after - ws) <= record["tokens_per_s"] <= 4096 / (before - ws)
    assert record["mfu"] is None and np.isfinite(record["tokens_per_s"])
