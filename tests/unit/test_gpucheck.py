"""tools/gpucheck/'s jobs, judging and report, without running a job (the CPU run is
tests/integration/test_gpucheck_cpu.py; the GPU run is `make gpu-check` on a CUDA machine)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tools.gpucheck import calibrate, cases, jobs, report
from trainer.config import load_config

ASSETS = {"model": "/m", "train": "/d/train.jsonl", "tokens": "/d/tokens.json"}


@pytest.mark.parametrize("name", list(cases.STRATEGIES))
@pytest.mark.parametrize("gpu", [True, False])
def test_every_strategy_is_a_valid_job_in_bf16_on_gpus_and_fp32_on_cpu(name, gpu):
    size = cases.GPU_SIZE if gpu else cases.CPU_SIZE
    cfg = load_config(cases.job_dict(name, size, 2, gpu, ASSETS, "/runs"))
    assert cfg.train.precision == ("bf16" if gpu else "fp32")
    assert cfg.scaling.use_gpu is gpu and cfg.scaling.num_workers == 2
    assert cfg.checkpoint.every_steps == size.steps // 2  # the resume point
    assert cfg.strategy.name == cases.STRATEGIES[name]["strategy"]["name"]


def test_the_gpu_model_is_about_0_6b_parameters():
    from trainer.planner.shape import ModelShape

    shape = ModelShape.from_hf_config(cases.llama_config(cases.GPU_SIZE, 520))
    assert 0.5e9 < shape.params < 1.0e9


def test_a_strategy_that_would_not_fit_gets_fewer_layers():
    size = cases.GPU_SIZE
    need = cases.predicted("ddp", size, 1)
    assert cases.fitted_size("ddp", size, 1, need / cases.FIT * 1.01) == size
    smaller = cases.fitted_size("ddp", size, 1, need / 2)
    assert smaller.layers < size.layers
    assert cases.predicted("ddp", smaller, 1) <= cases.FIT * need / 2


def _result(**over):
    r = {
        "strategy": "ddp",
        "world": 1,
        "losses": [6.0, 5.5, 5.0, 4.0],
        "stop_at": 2,
        "resumed_from": 2,
        "export_ok": True,
        "export_error": None,
        "predicted_over_measured": 1.1,
        "tokens_per_s": 1000.0,
        "mfu": 0.4,
        "params": 6e8,
    }
    return {**r, **over}


def test_a_good_job_passes_and_each_failure_is_named():
    assert report.judge(_result(), gpu=True) == []
    assert "loss did not fall" in report.judge(_result(losses=[5.0, 5.0, 5.1, 5.2]), True)[0]
    assert "did not resume from its step-2" in report.judge(_result(resumed_from=None), True)[0]
    bad = report.judge(_result(export_ok=False, export_error="OSError: x"), True)
    assert bad == ["export did not reload: OSError: x"]
    assert report.judge(_result(error="job exited 1"), True) == ["job exited 1"]


@pytest.mark.parametrize(("ratio", "ok"), [(0.86, True), (1.14, True), (0.84, False), (1.2, False)])
def test_predicted_over_measured_is_judged_within_15_percent_on_gpus_only(ratio, ok):
    r = _result(predicted_over_measured=ratio)
    assert (report.judge(r, gpu=True) == []) is ok
    assert report.judge(r, gpu=False) == []  # CPU: reported, not judged


def test_table_and_plot(tmp_path):
    rows = [_result(problems=[]), _result(strategy="zero3", problems=["loss did not fall ([])"])]
    text = report.table(rows, gpu=True)
    assert "40.0%" in text and "1.10" in text and "PASS" in text
    assert "÷bare" in text and report.table([_result(problems=[], vs_bare=0.97)], True).count(
        "0.97"
    )
    assert "FAIL: loss did not fall" in text
    assert "(not judged)" in report.table(rows, gpu=False)
    png = report.plot(rows, tmp_path / "r.png", gpu=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_is_written_after_every_job_and_a_cut_short_run_never_passes(tmp_path):
    good = _result(problems=[])
    partial = report.write_report(tmp_path, True, "NVIDIA H200", 1, [good], total=3)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["complete"] is False and on_disk["passed"] is False
    assert on_disk["gpu_run_done"] is False and partial == on_disk
    done = report.write_report(tmp_path, True, "NVIDIA H200", 1, [good] * 3, total=3)
    assert done["complete"] and done["passed"] and done["gpu_run_done"]
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True


@pytest.mark.parametrize(("ratio", "ok"), [(1.0, True), (1.09, True), (0.99, False), (1.11, False)])
def test_the_device_level_total_must_cover_the_measured_peak_within_10_percent(ratio, ok):
    r = _result(device_over_measured=ratio, predicted_over_measured=0.5)  # reserved: reported
    assert (report.judge(r, gpu=True) == []) is ok


def _gpu_row(name, world, tensors, peak, gpu_model="H200"):
    lines = {
        "cuda_context": 600 * 2**20,
        "nccl_buffers": 0.0 if world == 1 else 256 * 2**20,
        "cublas_workspaces": 64 * 2**20,
        "allocator_slack": 0.04 * tensors + 128 * 2**20,
    }
    return {
        "strategy": name,
        "world": world,
        "gpu_model": gpu_model,
        "tensors": tensors,
        "device_lines": lines,
        "device_predicted": tensors + sum(lines.values()),
        "device_peak": peak,
        "context_bytes": 500 * 2**20,
    }


def test_the_calibration_is_made_from_the_measured_rows_and_round_trips(tmp_path):
    from trainer.planner import calibration

    gib = 2**30
    rows = [
        _gpu_row("ddp", 1, 4 * gib, 4 * gib * 1.10 + (500 + 64 + 128) * 2**20),
        _gpu_row("ddp", 8, 4 * gib, 4 * gib * 1.10 + (500 + 64 + 128 + 256) * 2**20 + 0.2 * gib),
        _gpu_row("fsdp", 1, 2 * gib, 2 * gib + (500 + 64 + 128) * 2**20),
    ]
    meta = {"gpu_name": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0",
            "nccl": "2.28.3", "date": "2026-11-29", "expandable_segments": "true"}  # fmt: skip
    cal = calibrate.calibration_from(rows, meta)
    assert cal.gpu_model == "H200" and cal.context_bytes == 500 * 2**20
    ddp, fsdp = cal.strategies["ddp"], cal.strategies["fsdp"]
    assert ddp.slack_fraction == pytest.approx(0.10) and fsdp.slack_fraction == pytest.approx(0)
    # The calibrated model missed the 8-GPU row by 0.2 GiB: that is ddp's error (margin).
    assert ddp.error == pytest.approx(0.2 * gib / rows[1]["device_peak"])
    assert fsdp.error is None and ddp.measured == rows[0]["device_peak"]
    back = calibration.read(cal.write(tmp_path / "calibration.json"))
    assert back.to_dict() == cal.to_dict()
    assert calibrate.calibration_from([_gpu_row("ddp", 1, gib, None)], meta) is None


def test_rank_zero_writes_a_gzipped_profiler_trace_beside_the_report(tmp_path, monkeypatch):
    import gzip
    import types

    import torch

    from tools.gpucheck import worker

    cfg = types.SimpleNamespace(run=types.SimpleNamespace(name="gpucheck-ddp"))
    monkeypatch.setenv("GPUCHECK_TRACES", str(tmp_path / "traces"))
    monkeypatch.setenv("RANK", "0")
    with worker._profiled(cfg):
        (torch.ones(32, 32) @ torch.ones(32, 32)).sum()
    trace = json.loads(gzip.decompress((tmp_path / "traces" / "gpucheck-ddp.json.gz").read_bytes()))
    assert any("mm" in e.get("name", "") for e in trace["traceEvents"])
    monkeypatch.setenv("RANK", "1")  # other ranks write none
    with worker._profiled(types.SimpleNamespace(run=types.SimpleNamespace(name="x"))):
        pass
    assert not (tmp_path / "traces" / "x.json.gz").exists()


def test_the_mfu_case_is_llama_3_8b_shaped_with_the_most_layers_the_planner_fits():
    from tools.gpucheck import mfu
    from trainer.planner.shape import ModelShape

    big, _ = mfu.sizes()
    conf = cases.llama_config(big, 520)
    assert (conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"]) == (
        4096,
        32,
        8,
    )
    assert (conf["intermediate_size"], conf["vocab_size"], conf["num_hidden_layers"]) == (
        14336,
        128256,
        32,
    )
    assert 7.9e9 < ModelShape.from_hf_config(conf).params < 8.1e9  # Llama-3-8B's 8.03B
    h200 = 141e9
    fitted = jobs.case_size(mfu.CASE, cases.GPU_SIZE, 1, h200, None)
    assert 1 < fitted.layers < 32 and fitted.hidden == 4096  # 8B full FT does not fit one
    fits = cases.predicted(mfu.CASE, fitted, 1, 128256)
    more = replace(fitted, layers=fitted.layers + 1)
    assert fits <= cases.FIT * h200 < cases.predicted(mfu.CASE, more, 1, 128256)
    # CPU: one layer of 64, vocabulary 32,000; --steps applies, --layers does not.
    on_cpu = jobs.case_size(mfu.CASE, cases.CPU_SIZE, 2, None, 3)
    assert (on_cpu.layers, on_cpu.hidden, on_cpu.vocab, on_cpu.steps) == (1, 64, 32000, 3)
    assert jobs.case_size("ddp", cases.CPU_SIZE, 2, None, None) == cases.CPU_SIZE


def test_the_mfu_row_is_judged_on_finite_losses_and_an_mfu_on_gpus():
    from tools.gpucheck import mfu

    row = {"strategy": "mfu_8b", "kind": "mfu", "world": 1, "losses": [12.0, 11.5]}
    row.update(tokens_per_s=5000.0, mfu=0.41, layers=20, layers_of=32, params=5.1e9)
    assert report.judge(row, gpu=True) == []
    assert "not finite" in report.judge({**row, "losses": [12.0, float("nan")]}, True)[0]
    assert "no MFU" in report.judge({**row, "mfu": None}, gpu=True)[0]
    assert report.judge({**row, "mfu": None}, gpu=False) == []
    text = mfu.line({**row, "step_seconds": 0.5, "device": "NVIDIA H200"})
    assert "MFU at Llama-3-8B shape (20 of 32 layers, 5.10B params, 1 GPU(s)): 41.0%" in text
    assert "mfu_8b" in report.table([{**row, "problems": []}], gpu=True)


def test_cpu_peak_counts_anonymous_growth_when_the_kernel_drops_file_pages(tmp_path):
    """The CI failure it fixes: under memory pressure the kernel drops file-backed pages
    (torch's libraries) while a tiny run allocates a little, so the resident set's peak
    never passes its start and the old figure (VmHWM - VmRSS on entry) read <= 0."""
    import mmap

    from tools.gpucheck.probes import RssGrowth

    big = tmp_path / "pages"
    big.write_bytes(b"\1" * (160 << 20))
    with big.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == len(m) // 4096  # resident
        with RssGrowth() as growth:
            m.madvise(mmap.MADV_DONTNEED)  # what reclaim does to file pages: 160 MiB gone
            block = bytearray(48 << 20)  # then the run grows by 48 MiB of its own
            block[::4096] = b"\2" * len(block[::4096])
        del block
    assert 40 << 20 < growth.bytes < 120 << 20, growth.bytes
