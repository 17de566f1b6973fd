"""`raylift report` and `raylift status` read the benchmark scores back: the point before
step 1 (a `benchmark` event at step 0) and the steps that scored them, as a line per score
and a curve; status, the newest scores and their step."""

from __future__ import annotations

import json

from tools import report
from tools.jobcli import runs


def test_benchmark_scores_from_before_step_1_to_the_last_step(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    recs = [{"event": "benchmark", "attempt": 1, "step": 0, "time": 0.0, "eval/mc/acc": 0.25}]
    for s in range(1, 7):
        rec = {"event": "train", "attempt": 1, "step": s, "time": float(s), "loss": 3.0 - s / 10}
        rec.update(tokens_per_s=1000.0, lr=1e-3, grad_norm=1.0, epoch=0)
        if s % 3 == 0:
            rec.update({"eval/mc/acc": 0.25 + s / 12, "eval/gen/exact_match": s / 10})
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = report.load_run(str(run_dir))
    assert [r["step"] for r in run["steps"]] == list(range(1, 7))  # step 0 is no train step
    assert [r["step"] for r in run["benchmarks"]] == [0, 3, 6]
    lines = report.summary_lines(run)
    assert "gen/exact_match: 0.3000 (step 3) → 0.6000 (step 6)" in lines
    assert "mc/acc: 0.2500 (step 0) → 0.7500 (step 6)" in lines
    png = report.plot(run, tmp_path / "out" / "loss.png", "r1")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = {runs.RUN_KEY: "r1", "raylift_storage": str(tmp_path / "runs")}
    want = "gen/exact_match 0.6000, mc/acc 0.7500 (step 6)"
    assert runs.read_progress(meta).benchmarks == want
    assert runs.benchmarks_line([{"step": 1, "loss": 2.0}]) is None
