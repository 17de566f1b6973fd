"""MFU arithmetic, the peak table, and the history lineage across restarts."""

from __future__ import annotations

import threading
import time

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


def _steps_on(loc) -> list[int]:
    return [r["step"] for r in read_records(loc)]


def test_s3_history_is_rewritten_between_checkpoints_by_a_background_thread(s3_server):
    """S3 has no append: the history is one object, rewritten whole. Besides the
    checkpoints' flushes a background thread rewrites it every flush_every_s, so a hard
    kill between checkpoints takes at most that long of records with it (and the next
    attempt's journal counts the lost steps from what is there)."""
    loc = resolve("s3://ckpt/metrics-flush/metrics.jsonl", s3_server["endpoint"])
    first = MetricsFile(loc, [], flush_every_s=0.2)
    try:
        for step in (1, 2, 3):
            first.write({"event": "train", "step": step})
        deadline = time.monotonic() + 30
        while _steps_on(loc) != [1, 2, 3]:  # never flushed by hand
            assert time.monotonic() < deadline, _steps_on(loc)
            time.sleep(0.05)
    finally:
        first.close()
    deadline = time.monotonic() + 10
    while any(t.name == "raylift-metrics-flush" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the background flush did not stop at close()"
        time.sleep(0.05)

    # The next attempt keeps what is there; without the thread only a flush writes.
    second = MetricsFile(loc, read_records(loc), flush_every_s=0)
    second.write({"event": "train", "step": 4})
    assert _steps_on(loc) == [1, 2, 3]
    second.flush()
    assert _steps_on(loc) == [1, 2, 3, 4]
