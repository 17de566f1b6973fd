"""The planner plans the device, not the allocator (issue 47): the CUDA context, NCCL's
buffers per communicator, the cuBLAS workspaces and the allocator's slack are named lines
whose sum with the tensors is the total; a calibration file replaces the catalog's
figures for its GPU kind; a GPU fits only with a stated margin left; the plan's text says
how its total is made and prints a layout once."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import LLAMA2_7B, llama7b_job
from trainer.config import load_config
from trainer.planner import calibration as C
from trainer.planner import device as D
from trainer.planner import plan as P
from trainer.planner.memory import Setup, rank_memory
from trainer.planner.report import format_plan
from trainer.planner.shape import GIB, ModelShape

L7 = ModelShape.from_hf_config(LLAMA2_7B)
MIB = 2**20


def fsdp(**kw) -> Setup:
    return Setup("fsdp", world=16, micro_batch=8, block_size=512, checkpointing=True, **kw)


def test_the_total_is_the_tensors_plus_four_named_device_lines():
    r = rank_memory(L7, fsdp(), "A10G", 1)
    assert set(r.device) == {"cuda_context", "nccl_buffers", "cublas_workspaces", "allocator_slack"}
    assert r.overhead == pytest.approx(sum(r.device.values()))
    assert r.total == pytest.approx(r.tensors + sum(r.device.values()))
    # The old formula was a flat 1.5 GiB whatever the GPU, the job or the allocator.
    h200 = rank_memory(L7, fsdp(), "H200", 8)
    assert h200.device["cuda_context"] > r.device["cuda_context"]
    assert h200.device["cublas_workspaces"] == 64 * MIB  # sm90: 32 MiB cuBLAS + 32 cuBLASLt
    assert r.device["cublas_workspaces"] == pytest.approx((8.125 + 4) * MIB)
    assert r.overhead != 1.5 * GIB and h200.overhead != r.overhead


def test_nccl_counts_communicators_channels_and_connections():
    one = rank_memory(L7, Setup("ddp", world=1), "H200", 8)
    assert one.device["nccl_buffers"] == 0  # one rank: no communicator
    # DDP on one 8-GPU node: 1 communicator × 32 channels × 2 ring connections × 4 MiB.
    ddp = rank_memory(L7, Setup("ddp", world=8), "H200", 8)
    assert ddp.device["nccl_buffers"] == 32 * 2 * 4 * MIB
    # Across nodes the trees add connections; DeepSpeed makes its own dp group.
    assert rank_memory(L7, Setup("ddp", world=16), "H200", 8).device["nccl_buffers"] == (
        32 * 4 * 4 * MIB
    )
    assert D.communicators(Setup("zero3", world=8)) == 2
    # FSDP2 over a (dp 2, pp 2, tp 2) mesh: the default group plus one per dim.
    assert D.communicators(Setup("fsdp", world=8, tp=2, pp=2)) == 4
    assert D.communicators(Setup("fsdp", world=2, tp=2)) == 1  # tp spans the world
    assert D.communicators(Setup("fsdp", world=8)) == 1


def test_expandable_segments_shrink_the_allocator_slack():
    on = rank_memory(L7, fsdp(expandable_segments=True), "A10G", 1)
    off = rank_memory(L7, fsdp(expandable_segments=False), "A10G", 1)
    assert on.tensors == off.tensors
    assert off.device["allocator_slack"] > 3 * on.device["allocator_slack"]
    assert off.device_why["allocator_slack"].startswith("expandable segments off: 25%")


def test_the_config_switch_reaches_the_planner(tmp_path):
    cfg = load_config(llama7b_job(tmp_path), ["scaling.expandable_segments=false"])
    assert Setup.from_config(cfg).expandable_segments is False
    assert Setup.from_config(load_config(llama7b_job(tmp_path))).expandable_segments is True


def _calibration(**strategies) -> C.Calibration:
    return C.Calibration(
        gpu_name="NVIDIA A10G",
        gpu_model="A10G",
        torch="2.13.0+cu130",
        cuda="13.0",
        nccl="2.28.3",
        date="2026-11-29",
        context_bytes=700 * MIB,
        nccl_bytes_per_communicator=100 * MIB,
        strategies={k: C.StrategyCalibration(**v) for k, v in strategies.items()},
    )


def test_the_calibration_file_round_trips(tmp_path):
    cal = _calibration(fsdp={"slack_fraction": 0.1, "error": 0.08, "predicted": 9e9})
    path = cal.write(tmp_path / "_calibration" / "A10G.json")
    back = C.read(path)
    assert back.to_dict() == cal.to_dict() and back.source == str(path)
    assert back.for_strategy("fsdp") == C.StrategyCalibration(
        slack_fraction=0.1, error=0.08, predicted=9e9
    )
    assert C.find(str(tmp_path), "A10G").to_dict() == cal.to_dict()  # beside the runs
    assert C.find(str(tmp_path), "H200") is None and C.find("s3://b/runs", "A10G") is None
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format": 99}))
    with pytest.raises(Exception, match="format 99"):
        C.read(path)


def test_a_calibration_replaces_the_catalog_for_its_gpu_kind_only():
    cal = _calibration(fsdp={"slack_fraction": 0.1, "expandable_segments": True})
    r = rank_memory(L7, fsdp(), "A10G", 1, cal)
    assert r.device["cuda_context"] == 700 * MIB
    assert r.device["nccl_buffers"] == 100 * MIB
    assert r.device["allocator_slack"] == pytest.approx(0.1 * r.tensors + 128 * MIB)
    assert "calibrated 2026-11-29" in r.device_why["cuda_context"]
    other = rank_memory(L7, fsdp(), "H200", 8, cal)
    assert other.device["cuda_context"] == 600 * MIB  # not this GPU's calibration
    # A slack measured with expandable segments says nothing about them off.
    off = rank_memory(L7, fsdp(expandable_segments=False), "A10G", 1, cal)
    assert off.device["allocator_slack"] == pytest.approx(0.25 * off.tensors + 128 * MIB)


def test_a_gpu_fits_only_with_the_margin_left():
    s = fsdp()
    need = rank_memory(L7, s, "A10G", 1).total
    assert need < 24 * GIB
    assert D.margin(s) == (0.05, "the planner's minimum")
    assert P.layout(L7, s, "g5.xlarge").nodes[0].gpu_verdict != "does not fit"
    # A margin that leaves less than the need does not fit, although the need < 24 GiB.
    tight = 1 - need / (24 * GIB) + 0.01
    assert P.layout(L7, s, "g5.xlarge", margin=tight).nodes[0].gpu_verdict == "does not fit"
    cal = _calibration(fsdp={"error": 0.12})
    assert D.margin(s, cal) == (0.12, "fsdp's error in the calibration")
    assert D.margin(s, cal, history_shortfall=0.2)[0] == 0.2
    assert D.margin(Setup("ddp"), cal)[0] == 0.05  # another strategy's error is not ddp's


def test_the_plan_says_how_its_total_is_made_and_prints_a_layout_once():
    p = P.plan(L7, fsdp(), "g5.xlarge", rank0_instance="g5.12xlarge")
    text = format_plan(p)
    r = p.rank
    g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
    assert (
        f"= tensors {g(r.tensors)} + context {g(r.device['cuda_context'])} + NCCL "
        f"{g(r.device['nccl_buffers'])} + cuBLAS {g(r.device['cublas_workspaces'])} + slack "
        f"{g(r.device['allocator_slack'])}" in text
    )
    assert f"= weights {g(r.weights)} + optimizer {g(r.optimizer)} + held gradients" in text
    for label in ("CUDA context", "NCCL buffers", "cuBLAS workspaces", "allocator slack"):
        assert f"  {label} " in text
    assert "fit margin 5% (the planner's minimum)" in text
    assert "framework overhead" not in text
    # g5.xlarge is also the cheapest layout: its table is printed once.
    assert text.count("node type") == 1 and "cheapest layout that fits: the layout above" in text
    # Where they differ, both are printed.
    other = format_plan(P.plan(L7, fsdp(), "g5.48xlarge"))
    assert other.count("node type") == 2 and "the layout above" not in other


def test_plan_help_keeps_its_whole_description(capsys):
    from tools import plan as tool

    with pytest.raises(SystemExit):
        tool.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "a verdict per node type, the cheapest catalog layout that fits and what an epoch costs."
        in out
    )


def test_every_catalog_gpu_has_its_device_figures_and_a_source():
    from trainer.planner.catalog import load_instances

    cat = D.catalog()
    for section in ("software", "nccl", "allocator"):
        assert cat[section]["source"]
    for name, g in cat["gpus"].items():
        assert g["source"] and g["context_mib"] > 0 and g["nccl_channels"] > 0, name
    for inst in load_instances().values():
        if inst.gpu_model:
            assert inst.gpu_model in cat["gpus"], inst.name


def test_plan_reads_past_runs_and_widens_the_margin_when_they_measured_above_plan(tmp_path, capsys):
    from trainer.__main__ import main
    from trainer.planner.memory import Setup as S

    job = llama7b_job(tmp_path)
    sets = ["strategy.name=fsdp", "scaling.num_workers=16", "model.gradient_checkpointing=true"]
    cfg = load_config(job, sets)
    planned = rank_memory(L7, S.from_config(cfg), "A10G").total
    args = ["plan", str(job), "--instance", "g5.xlarge", "--json"]
    args += [x for s in sets for x in ("--set", s)]
    assert main(args) in (0, 2)
    assert json.loads(capsys.readouterr().out)["margin"] == 0.05  # no history yet

    def past(name: str, ratio: float, gpu: str = "NVIDIA A10G") -> None:
        run = tmp_path / "runs" / name
        (run / "device_memory").mkdir(parents=True)
        (run / "job.json").write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
        peak = {"rank": 0, "kind": "cuda", "device": gpu, "dev_steady_step_gib": 0.0}
        peak["dev_steady_step_gib"] = ratio * planned / GIB
        (run / "device_memory" / "rank0.json").write_text(json.dumps(peak))

    past("under", 0.9)
    past("over", 1.2)
    past("other-gpu", 2.0, gpu="NVIDIA H200")  # another GPU kind: not this plan's evidence
    assert main(args) in (0, 2)
    out = json.loads(capsys.readouterr().out)
    assert out["margin"] == pytest.approx(0.2)
    assert out["margin_why"] == "past fsdp runs measured above plan"
    assert out["history"][0].startswith("history: 2 past fsdp run(s) on A10G")
    assert "from 0.90 to 1.20" in out["history"][0]
