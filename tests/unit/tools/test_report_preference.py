"""A preference run's TRL metrics in `raylift status` and `raylift report` (text and plot)."""

from __future__ import annotations

import json

from tools import report
from tools.jobcli import runs


def _write(path):
    recs = []
    for s in range(1, 9):
        acc = min(0.5 + 0.1 * s, 1.0)
        recs.append(
            {
                "event": "train",
                "attempt": 1,
                "step": s,
                "loss": 0.69 - 0.05 * s,
                "tokens_per_s": 1000.0,
                "tokens_seen": 640 * s,
                "rewards/chosen": 0.1 * s,
                "rewards/rejected": -0.1 * s,
                "rewards/margins": 0.2 * s,
                "rewards/accuracies": acc,
                "logps/chosen": -20.0,
                "logps/rejected": -30.0,
            }
        )
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_status_and_report_show_the_rewards(tmp_path):
    run_dir = tmp_path / "runs" / "dpo"
    _write(run_dir / "metrics.jsonl")
    run = report.load_run(str(run_dir))
    want = "accuracies 1.00, margins 1.600 (chosen 0.800, rejected -0.800)"
    assert f"rewards (last step): {want}" in report.summary_lines(run)
    png = report.plot(run, tmp_path / "out" / "loss.png", "dpo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = {runs.RUN_KEY: "dpo", "raylift_storage": str(tmp_path / "runs")}
    assert runs.read_progress(meta).rewards == want
    assert runs.rewards_line({"loss": 1.0}) is None  # an SFT run has no rewards line
