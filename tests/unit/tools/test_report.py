"""tools/report/: the figures it prints and the plot it draws, from a real metrics file
with a restart in it."""

from __future__ import annotations

import json

from tools import report


def _write_history(path):
    recs = []
    for s in range(1, 11):  # attempt 1 trains 10 steps, then dies
        recs.append(
            {
                "event": "train",
                "attempt": 1,
                "step": s,
                "loss": 5.0 - 0.1 * s,
                "tokens_per_s": 1000.0,
            }
        )
    recs.append({"event": "resume", "attempt": 2, "from_step": 8})  # 9 and 10 are lost
    for s in range(9, 21):
        rec = {
            "event": "train",
            "attempt": 2,
            "step": s,
            "loss": 5.0 - 0.2 * s,
            "tokens_per_s": 2000.0,
        }
        if s in (10, 20):
            rec.update(eval_loss=1.5 if s == 20 else 2.5, eval_perplexity=4.4817)
        recs.append(rec)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_summary_figures_and_plot(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    _write_history(run_dir / "metrics.jsonl")
    run = report.load_run(str(run_dir))
    assert [r["step"] for r in run["steps"]] == list(range(1, 21))
    assert (run["restarts"], run["wasted_steps"]) == (1, 2)
    lines = report.summary_lines(run)
    assert lines[0] == "steps: 20  (restarts: 1, steps lost to restarts: 2)"
    assert lines[1] == "loss: 4.9000 → 1.0000"
    # Second half of the final lineage: steps 11..20, all from attempt 2.
    assert lines[2] == "tokens/s (all workers, second half of the run): 2,000"
    assert lines[3] == "eval loss: 1.5000 (perplexity 4.48)"

    png = report.plot(run, tmp_path / "out" / "loss.png", "r1")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_empty_run_says_so(tmp_path):
    assert report.summary_lines(report.load_run(str(tmp_path / "none"))) == ["no steps recorded"]


def test_journal_lines_say_what_faults_cost(tmp_path):
    from trainer.resilience import journal
    from trainer.storage.location import resolve

    run_dir = tmp_path / "runs" / "r2"
    _write_history(run_dir / "metrics.jsonl")
    j = journal.Journal(resolve(str(run_dir)), "attempt-1-rank0")
    j.add("attempt", attempt=1, world_size=2, from_step=0, lost_steps=0, lost_s=None)
    j.add("checkpoint", step=8, kind="periodic", save_s=0.25, upload_s=1.5)
    journal.Journal(resolve(str(run_dir)), "controller-1").add(
        "failure", cause="node_lost", ranks=[1], message="node died"
    )
    k = journal.Journal(resolve(str(run_dir)), "attempt-2-rank0")
    k.add("attempt", attempt=2, world_size=2, from_step=8, lost_steps=2, lost_s=18.4)
    k.add("preemption", step=15, deadline_s=100.0, save_s=2.0, margin_s=98.0)
    lines = report.summary_lines(report.load_run(str(run_dir)))
    assert lines[4:] == [
        "attempts: 2 (failures: 1 node_lost); lost per restart: [2] steps, 18 s in all",
        "checkpoints: 1 (mean save 0.25 s, mean upload 1.50 s, upload retries 0)",
        "spot notice at step 15: saved in 2.0 s with 100 s left",
        "cost: no nodes recorded for this run (recorded by its driver from this version on)",
    ]


def _worker_fields(step: int) -> dict:
    """Per-worker values as the loop records them: rank 1 grows, rank 0 stays flat."""
    mem = [2.0, 2.0 + 0.5 * step]
    phases = {"data": 0.01, "fwd_bwd": 0.3, "optim": 0.05, "ckpt": 0.4 * (step == 5), "eval": 0}
    rec = {"mem_capacity_gib": 24.0, "per_rank": {"mem_reserved_gib": mem}}
    for field, values in (("mem_reserved_gib", mem), ("mem_peak_gib", mem)):
        rec.update({f"{field}_max": max(values), f"{field}_max_rank": 1})
    rec["mem_peak_pct_max"] = 100 * max(mem) / 24.0
    rec.update(alloc_retries_max=0.0, ooms_max=0.0)
    for name, t in phases.items():
        rec.update({f"t_{name}_s_mean": t, f"t_{name}_s_max": t * 1.5, f"t_{name}_s_max_rank": 1})
    return rec


def test_worker_memory_and_step_breakdown(tmp_path):
    run_dir = tmp_path / "runs" / "w"
    run_dir.mkdir(parents=True)
    recs = [
        {"event": "train", "attempt": 1, "step": s, "loss": 3.0, "tokens_per_s": 9.0}
        | _worker_fields(s)
        for s in range(1, 9)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = report.load_run(str(run_dir))
    lines = report.summary_lines(run)
    assert "fullest worker: rank 1: 6.00 GiB peak (25% of 24.0 GiB)" in lines
    # Steps 5-8: the checkpoint of step 5 (0.4 s) is spread over the four steps.
    assert (
        "slowest part of a step (second half of the run): forward+backward 0.300 s of "
        "0.460 s per step (65%); slowest rank 1" in lines
    )
    png = report.plot(run, tmp_path / "w.png", "w")
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 800  # two rows of plots: loss/throughput, memory/breakdown


def test_plot_without_worker_records(tmp_path):
    run_dir = tmp_path / "runs" / "old"
    _write_history(run_dir / "metrics.jsonl")
    png = report.plot(report.load_run(str(run_dir)), tmp_path / "old.png", "old")
    assert png.stat().st_size > 10_000


def test_step_breakdown_describes_the_run_not_its_last_step(tmp_path):
    """The last step runs the final eval; the summary must still name the phase that
    dominates the run's steps, with the eval spread over the steps it serves."""
    run_dir = tmp_path / "runs" / "e"
    run_dir.mkdir(parents=True)
    recs = []
    for s in range(1, 21):
        rec = {"event": "train", "attempt": 1, "step": s, "loss": 3.0, "tokens_per_s": 9.0}
        phases = {"data": 0.001, "fwd_bwd": 0.02, "optim": 0.002, "ckpt": 0.0}
        phases["eval"] = 0.06 if s == 20 else 0.0
        for name, t in phases.items():
            rank = 0 if name == "eval" else 1
            rec.update({f"t_{name}_s_mean": t, f"t_{name}_s_max": t, f"t_{name}_s_max_rank": rank})
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = report.summary_lines(report.load_run(str(run_dir)))
    assert (
        "slowest part of a step (second half of the run): forward+backward 0.020 s of "
        "0.029 s per step (69%); slowest rank 1" in lines
    ), lines
