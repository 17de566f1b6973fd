"""tools/gpucheck/loss.py, gpu-check's loss-kernel bench (issue 47): its CPU run writes
loss.json with the plain and chunked kernels against the fp32 reference and liger
reported as not installed; a kernel that errs or drifts past the tolerance fails the run.
(Its figures are the GPU's: make gpu-check.)"""

from __future__ import annotations

import json

from tools.gpucheck import loss as gpucheck_loss


def test_the_cpu_run_writes_every_kernel_against_the_reference(tmp_path):
    assert gpucheck_loss.main(["--cpu", "--iters", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "loss.json").read_text())
    rows = {r["kernel"]: r for r in report["rows"]}
    assert not report["gpu"] and report["tolerance"] == 1e-5
    assert rows["liger"]["error"] == gpucheck_loss.MISSING  # CPU tests never need it
    for name in ("plain", "chunked"):
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["peak_mib"] is None
        for part in ("loss", "grad_h", "grad_w"):
            assert rows[name][f"{part}_rel_err"] <= 1e-5, (name, part)
    assert "chunked" in gpucheck_loss.table(report["rows"], 1e-5)


def test_a_failed_or_inexact_kernel_fails_the_run():
    good = {"kernel": "liger", "loss_rel_err": 1e-3, "grad_h_rel_err": 0, "grad_w_rel_err": 0}
    assert gpucheck_loss.within(good, 2e-2)
    assert not gpucheck_loss.within({**good, "grad_w_rel_err": 0.05}, 2e-2)
    assert not gpucheck_loss.within({"kernel": "liger", "error": "OutOfMemoryError: x"}, 2e-2)
    assert gpucheck_loss.within({"kernel": "liger", "error": gpucheck_loss.MISSING}, 2e-2)
