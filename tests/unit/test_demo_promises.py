"""`make demo` checks what it promises on what it left behind, and fails when a promise is
broken (CI runs it after `make test`; the real end-to-end run is that step)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tools.demo import broken_promises


def _left_behind(tmp_path: Path, tiny: dict[str, Path]) -> tuple[Path, dict, dict, Path]:
    run_dir = tmp_path / "runs" / "demo"
    for step in (50, 75):
        (run_dir / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    export = run_dir / "export" / "step_00000075"
    shutil.copytree(tiny["model"], export / "model")
    steps = [{"step": i, "loss": 6.0 - i * 0.03} for i in range(1, 76)]
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    run = {"steps": steps, "restarts": 0, "benchmarks": [{"step": 0}, {"step": 75}]}
    return run_dir, run, {"export": str(export)}, png


def test_a_demo_that_kept_its_promises_passes(tmp_path, tiny):
    assert broken_promises(*_left_behind(tmp_path, tiny)) == []


def test_each_broken_promise_is_named(tmp_path, tiny):
    run_dir, run, summary, png = _left_behind(tmp_path, tiny)
    run["steps"][-1]["loss"] = 6.0  # did not learn
    run["restarts"] = 1
    shutil.rmtree(run_dir / "step_00000075")  # the final checkpoint is missing
    (run_dir / "export" / "step_00000075" / "model" / "model.safetensors").write_bytes(b"x")
    png.write_bytes(b"GIF89a")
    run["benchmarks"] = run["benchmarks"][:1]  # not scored after training
    problems = broken_promises(run_dir, run, summary, png)
    assert len(problems) == 6, problems
    words_each = ("restarts", "did not fall", "want the newest two", "does not load", "PNG")
    for words in (*words_each, "benchmark was not scored"):
        assert any(words in p for p in problems), (words, problems)
    run["steps"] = run["steps"][:10] + run["steps"][11:]  # a step missing
    assert broken_promises(run_dir, run, summary, png)[0].startswith("steps are not 1..N")
