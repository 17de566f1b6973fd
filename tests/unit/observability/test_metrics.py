"""MFU arithmetic, the peak table, and the history lineage across restarts."""

from __future__ import annotations

import pytest

from trainer.observability.metrics import MetricsFile, lineage, mfu, peak_flops, read_records
from trainer.storage.location import resolve


def test_peak_lookup():
    assert peak_flops("NVIDIA A10G", "bf16") == 70e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops("NVIDIA H200", "bf16") == 989e12  # what torch names the lent H200
    assert peak_flops(None, "fp32") is None  # CPU: n/a, not a made-up number
    assert peak_flops("Some Future GPU", "bf16") is None


def test_mfu():
    # 7B params at 1,000 tokens/s/device on an A10G in bf16: 6·7e9·1e3 / 70e12 = 0.6
    assert mfu(7_000_000_000, 1_000, 70e12) == pytest.approx(0.6)
    assert mfu(10, 10, None) is None


def test_lineage_drops_rolled_back_steps():
    recs = [{"event": "train", "step": s, "attempt": 1} for s in range(1, 8)]
    recs.append({"event": "resume", "from_step": 4, "attempt": 2})
    recs += [{"event": "train", "step": s, "attempt": 2} for s in range(5, 11)]
    steps, wasted = lineage(recs)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert wasted == 3
    assert {r["attempt"] for r in steps if r["step"] > 4} == {2}


def test_metrics_file_append_and_torn_line(tmp_path):
    loc = resolve(str(tmp_path)).join("metrics.jsonl")
    mf = MetricsFile(loc)
    mf.write({"event": "train", "step": 1, "loss": 2.0})
    mf.write({"event": "train", "step": 2, "loss": 1.5})
    with open(loc.path, "a") as f:
        f.write('{"event": "train", "st')  # a writer killed mid-line
    assert [r["step"] for r in read_records(loc)] == [1, 2]
