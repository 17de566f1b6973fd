"""`raylift status` and `raylift report` read an online RL run's rewards back from its
metrics file: status names the newest rollout's reward, reward_std and each function's
mean with its step, and an ETA from the step time (tokens_per_s counts the update's real
tokens, which tokens_seen does not); the report's summary and plot carry the reward."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

from tools import report
from tools.jobcli import runs
from tools.report.plots import _plot_rl_reward


def _rl_run(tmp_path):
    run_dir = tmp_path / "runs" / "rl1"
    run_dir.mkdir(parents=True)
    recs = []
    for s in range(1, 7):
        rec = {"event": "train", "attempt": 1, "step": s, "time": float(s), "loss": 0.01}
        rec.update(tokens_per_s=50.0, lr=1e-6, grad_norm=1.0, epoch=0, tokens_seen=512 * s)
        rec.update({"tokens/update": 100.0, "step_time_s": 2.0})
        if s % 2 == 1:  # num_iterations 2: even steps reuse the rollout before them
            rec.update(reward=s / 10, reward_std=0.05 * s)
            rec.update({"rewards/math_answer/mean": s / 20, "rewards/format_regex/mean": 0.5})
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_dir


def test_status_and_report_show_an_rl_runs_reward(tmp_path) -> None:
    run_dir = _rl_run(tmp_path)
    meta = {runs.RUN_KEY: "rl1", "raylift_storage": str(tmp_path / "runs")}
    p = runs.read_progress(meta, total=10)
    assert p.rewards == "reward 0.5000 ± 0.2500, format_regex 0.5000, math_answer 0.2500 (step 5)"
    assert p.eta_s == 8.0  # 4 steps left at 2 s, not 512 tokens a step at 50 tokens/s
    assert runs.reward_line([{"step": 1, "loss": 2.0}]) is None

    run = report.load_run(str(run_dir))
    assert "reward: 0.1000 (step 1) → 0.5000 (step 5)" in report.summary_lines(run)
    png = report.plot(run, tmp_path / "out" / "loss.png", "rl1")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    twin = _plot_rl_reward(ax, run["steps"])
    (line,) = twin.get_lines()
    assert list(line.get_xdata()) == [1, 3, 5] and list(line.get_ydata()) == [0.1, 0.3, 0.5]
    (band,) = twin.collections  # reward ± reward_std
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert abs(low - 0.05) < 1e-9 and abs(high - 0.75) < 1e-9
    assert _plot_rl_reward(ax, [{"step": 1, "loss": 2.0}]) is None  # SFT: no panel
    plt.close(fig)
