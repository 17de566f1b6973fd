"""`make demo` as a new user runs it: its own local cluster, the submit → Ray Train path,
and what it promises to leave behind (checkpoints, a plot, the figures it prints)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py"), "--out", str(out), "--rows", "1500"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    # Readable: rank 0's step lines once each, not Ray's per-rank report dumps.
    assert "Reporting training result" not in text
    step_lines = re.findall(r"step (\d+)/(\d+) loss", text)
    total = int(step_lines[-1][1])
    assert [int(s) for s, _ in step_lines] == list(range(1, total + 1))

    tail = text[text.index("=== Raylift demo: done ===") :]
    run_dir = next((out / "runs").iterdir())
    run = report.load_run(str(run_dir))
    for line in report.summary_lines(run):  # the figures it prints are the run's own
        assert line in tail
    assert run["steps"][-1]["step"] == total and run["restarts"] == 0
    assert run["steps"][-1]["loss"] < run["steps"][0]["loss"] - 1.0

    ckpts = sorted(p.name for p in run_dir.glob("step_*"))
    assert ckpts and ckpts[-1] == f"step_{total:08d}" and len(ckpts) <= 2  # keep_last: 2
    assert (run_dir / ckpts[-1] / "trainer_state.json").is_file()
    assert (run_dir / "export" / ckpts[-1] / "model" / "config.json").is_file()
    # The path it prints loads with plain transformers.
    printed = re.search(r"from_pretrained\): (\S+)", tail).group(1)
    assert Path(printed) == run_dir / "export" / ckpts[-1] / "model"
    png = Path(re.search(r"loss curve: (\S+\.png)", tail).group(1))
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
