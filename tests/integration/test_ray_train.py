"""Real Ray Train runs on a three-node local cluster, submitted through the Jobs API the
way tools/submit.py submits to a production cluster. Tiny Llama, CPU, gloo."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.ray_jobs import history, run_to_end
from tools.jobcli.client import client_for
from tools.jobcli.main import main
from trainer.resilience import journal
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow


def test_ddp_run_lowers_loss_and_exports_loadable_hf_checkpoint(ddp_reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, summary = ddp_reference["cfg"], ddp_reference["summary"]
    _, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, 13))
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in steps)  # CPU: MFU n/a
    assert [r["step"] for r in steps if "eval_loss" in r] == [6, 12]
    # Readable logs: rank 0's step lines once each, not Ray's per-rank report dumps.
    logs = ddp_reference["logs"]
    assert "Reporting training result" not in logs
    assert [int(s) for s in re.findall(r"step (\d+)/12 loss", logs)] == list(range(1, 13))

    run_dir = ddp_reference["run_dir"]
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00000008", "step_00000012"]
    final = run_dir / "step_00000012"
    assert summary["checkpoint"] == str(final)
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["world_size"] == 2
    assert state["format"] == 2 and state["strategy"] == "ddp" and state["layout"] == "ddp/1"
    assert state["rank0_node_labels"].get("large_cpu_mem") == "true"
    # The export is separate from the resume state: only at the end (no export_every).
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["step_00000012"]
    export = run_dir / "export" / "step_00000012" / "model"
    assert summary["export"] == str(export.parent)

    # Plain transformers, no trainer code: same logits as the model at the end of training.
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert "<START_Q>" in tok.get_vocab()
    probe = json.loads((run_dir / "final_probe.json").read_text())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(probe["input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(probe["logits"]), atol=1e-5, rtol=1e-5)


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_resume_is_exact_and_takes_a_newer_complete_checkpoint_than_rays_own(
    ray_cluster, job, ddp_reference
):
    """The reference trains 12 steps straight. B stops after 4 on Ray; a torchrun run of
    the same run name takes it to 8 (so storage holds a complete step 8 that Ray never saw
    reported, as a worker killed before the controller's poll also leaves one); a fresh Ray
    submission must resume from 8, not from Ray's own 4, and finish at 12. Same world
    size, so the gloo reductions run in the same order: we allow 1e-6 absolute for
    floating-point reduction order, and in practice the weights come out bit-identical."""
    from tests.support.torchrun import torchrun

    job_b = job("exact-b")
    run_to_end(ray_cluster, job_b, ["train.stop_at_step=4"])  # Ray knows step 4
    res = torchrun(["-m", "trainer", "run", str(job_b), "--set", "train.stop_at_step=8"])
    assert res.returncode == 0, res.stderr[-3000:]  # storage now has step 8, Ray does not
    cfg_b, _, _ = run_to_end(ray_cluster, job_b)

    records, steps_b, wasted = history(cfg_b)
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [r["from_step"] for r in resumes] == [4, 8] and wasted == 0
    _, steps_a, _ = history(ddp_reference["cfg"])
    assert [r["step"] for r in steps_b] == list(range(1, 13))
    for ra, rb in zip(steps_a, steps_b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6), ra["step"]

    # The journal counts a resubmission after a clean stop as costing nothing.
    attempts = [r for r in journal.read(resolve(cfg_b.storage.path).join("exact-b"))]
    assert [
        (a["from_step"], a["lost_steps"], a["lost_s"]) for a in attempts if a["event"] == "attempt"
    ] == [(0, 0, None), (4, 0, None), (8, 0, None)]
    assert [a["event"] for a in attempts if a["event"] in ("stopped", "finished")] == [
        "stopped",
        "stopped",
        "finished",
    ]
    ref, run_b = ddp_reference["run_dir"], Path(cfg_b.storage.path) / "exact-b"
    wa = load_file(str(ref / "export/step_00000012/model/model.safetensors"))
    wb = load_file(str(run_b / "export/step_00000012/model/model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=k)
    oa = torch.load(ref / "step_00000012/strategy/optimizer.pt")
    ob = torch.load(run_b / "step_00000012/strategy/optimizer.pt")
    for i, sa in oa["state"].items():
        torch.testing.assert_close(
            sa["exp_avg_sq"], ob["state"][i]["exp_avg_sq"], atol=1e-9, rtol=0
        )


def test_malformed_line_deep_in_file_fails_on_cluster_with_file_line(
    ray_cluster, job, tiny, tmp_path, capsys
):
    """The client's preflight reads only the first lines, so this job fails on the
    cluster: `submit.py` exits 1 and shows the job's one-line error."""
    good = tiny["train"].read_text().splitlines()
    bad = tmp_path / "deep.jsonl"
    bad.write_text("\n".join([*good[:1200], '{"input": 12}', *good[1200:1300]]) + "\n")
    path = job("badline")
    argv = [str(path), "--address", ray_cluster.dashboard_url, "--no-progress"]
    rc = main([*argv, "--set", f"data.train_file={bad}"])
    out = capsys.readouterr()
    assert rc == 1
    assert "error: job raylift-badline-" in out.err and " FAILED" in out.err
    tail = [x for x in out.err.splitlines() if x.startswith("  | ")]
    assert any(f'{bad}:1201: "input" must be a string' in x for x in tail), out.err
    assert "Traceback" not in out.out + out.err  # one clear line, not a stack
    assert not (tmp_path / "runs" / "badline").exists()  # no worker ever started


def test_stopped_job_exits_1(ray_cluster, job, capsys):
    import threading

    path = job("stopme", train={"max_steps": 5000, "eval_every": None})
    client = client_for(ray_cluster.dashboard_url)
    stopped: list[str] = []

    def stop_when_running():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not stopped:
            for info in client.list_jobs():
                meta = info.metadata or {}
                if meta.get("raylift_run") == "stopme" and str(info.status) in (
                    "RUNNING",
                    "JobStatus.RUNNING",
                ):
                    client.stop_job(info.submission_id)
                    stopped.append(info.submission_id)
                    return
            time.sleep(0.2)

    t = threading.Thread(target=stop_when_running, daemon=True)
    t.start()
    rc = main([str(path), "--address", ray_cluster.dashboard_url, "--no-progress"])
    t.join(timeout=600)
    err = capsys.readouterr().err
    assert stopped, "the job never reached RUNNING"
    assert rc == 1 and f"error: job {stopped[0]} STOPPED" in err


def test_jobs_api_requires_the_cluster_token(ray_cluster, job, monkeypatch, capsys):
    import urllib.error
    import urllib.request

    def status(headers: dict[str, str]) -> int:
        req = urllib.request.Request(ray_cluster.dashboard_url + "/api/jobs/", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status({}) == 401
    assert status({"Authorization": "Bearer " + "0" * 64}) == 403
    assert status(ray_cluster.auth_headers) == 200
    # The submit tool with a wrong token is refused with one clear line, nothing submitted.
    before = len(client_for(ray_cluster.dashboard_url).list_jobs())
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    rc = main([str(job("noauth")), "--address", ray_cluster.dashboard_url])
    err = capsys.readouterr().err
    assert rc == 2 and "error: the Ray cluster at" in err and "refused the token" in err, err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert len(client_for(ray_cluster.dashboard_url).list_jobs()) == before


def test_submit_rejects_bad_input_before_submitting(ray_cluster, job, capsys):
    before = len(client_for(ray_cluster.dashboard_url).list_jobs())
    rc = main(
        [
            str(job("rejected")),
            "--address",
            ray_cluster.dashboard_url,
            "--set",
            "data.block_size=100000",
        ]
    )
    assert rc == 2
    assert "data.block_size: 100000 exceeds the model's max_position_embeddings" in (
        capsys.readouterr().err
    )
    assert len(client_for(ray_cluster.dashboard_url).list_jobs()) == before
