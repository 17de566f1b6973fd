"""The same loop without Ray: `python -m trainer run` under torchrun (the Slurm and
Kubernetes path), with the {"text": ...} data format, stop and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.torchrun import torchrun as run_torchrun
from tools.tiny import write_dataset
from trainer.observability.logs import SUMMARY_MARK, find_marked
from trainer.observability.metrics import lineage, read_records
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow


def torchrun(job_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["-m", "trainer", "run", str(job_path)]
    for o in overrides:
        args += ["--set", o]
    return run_torchrun(args, timeout=600)


def test_torchrun_text_format_trains_checkpoints_and_exports(job, tmp_path):
    """Under torchrun, on plain-text rows. (Resuming under torchrun, from a checkpoint a
    Ray run wrote, is part of test_ray_train's exact-resume test.)"""
    data = write_dataset(tmp_path / "text.jsonl", 1500, seed=3, fmt="text")
    path = job(
        "tr",
        data={"train_file": str(data), "eval_file": None},
        tracking={"tensorboard": True, "per_rank_every": 4},
    )
    res = torchrun(path)
    assert res.returncode == 0, res.stderr[-3000:]

    run = resolve(str(tmp_path / "runs")).join("tr")
    records = read_records(run.join("metrics.jsonl"))
    steps, wasted = lineage(records)
    assert [r["step"] for r in steps] == list(range(1, 13)) and wasted == 0
    lowered = sum(r["loss"] for r in steps[-3:]) < sum(r["loss"] for r in steps[:3]) - 1.0
    assert lowered, [r["loss"] for r in steps]
    ckpts = sorted(p.name for p in Path(run.path).glob("step_*"))
    assert ckpts == ["step_00000008", "step_00000012"]  # keep_last=2
    state = json.loads((Path(run.path) / "step_00000012" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["tokens_seen"] == 12 * 8 * 32
    found = (find_marked(line, SUMMARY_MARK)[0] for line in res.stdout.splitlines())
    summary = next(s for s in found if s is not None)
    assert summary["checkpoint"].endswith("step_00000012")
    # Every logged step has both ranks' memory and step phases; every 4th record (and the
    # first) each rank's own values; the TensorBoard event file is in the run folder.
    assert all(r["mem_peak_gib_max"] > 0.1 and r["t_fwd_bwd_s_max"] > 0 for r in steps)
    assert all(r["mem_peak_gib_max_rank"] in (0, 1) for r in steps)
    assert [r["step"] for r in steps if "per_rank" in r] == [1, 4, 8, 12]
    assert all(len(r["per_rank"]["host_rss_gib"]) == 2 for r in steps if "per_rank" in r)
    # A checkpoint's stall lands in the record after it (steps 4 and 8 save).
    ckpt = {r["step"]: r["t_ckpt_s_max"] for r in steps}
    assert min(ckpt[5], ckpt[9]) > max(ckpt[s] for s in (2, 3, 6, 7)), ckpt
    (events,) = Path(run.path, "tensorboard").glob("events.out.tfevents.*.attempt-1")
    assert events.stat().st_size > 1000


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_torchrun_trains_on_while_a_checkpoint_uploads(job, tmp_path):
    """Under torchrun a periodic checkpoint uploads in the background: with step 4's upload
    held before its manifests, training goes on to step 8, whose checkpoint then waits for
    the one upload slot (step 9 does not start); released, every checkpoint completes."""
    import time

    from tests.support.torchrun import torchrun_command
    from trainer.checkpoint import manager as ckpt_mod
    from trainer.resilience import journal

    release = tmp_path / "release"
    cmd, env = torchrun_command(["-m", "trainer", "run", str(job("bg"))])
    env["RAYLIFT_FAULT_HOLD_UPLOAD"] = f"4:{release}"
    out = tmp_path / "torchrun.log"
    with out.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def wait_for(what: str, ready, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not ready():
                assert proc.poll() is None, f"ended waiting for {what}: {out.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"{what}: {out.read_text()[-3000:]}"
                time.sleep(0.2)

        markers = [release.with_name(f"release.upload.r{r}") for r in (0, 1)]
        wait_for("step 4's upload held", lambda: all(m.exists() for m in markers), 600)
        # Four tiny steps take seconds even on a loaded machine; a step that waited for
        # the held upload would never get there.
        wait_for("step 8 trained", lambda: "step 8/12 " in out.read_text(), 180)
        assert "step 9/12 " not in out.read_text()  # the second checkpoint waits for a slot
        release.touch()
        assert proc.wait(timeout=600) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run = resolve(str(tmp_path / "runs")).join("bg")
    saved = [r["step"] for r in journal.read(run) if r["event"] == "checkpoint"]
    assert saved == [4, 8, 12], saved
    for _, loc in ckpt_mod.list_checkpoints(run):
        assert ckpt_mod.completeness(loc)[0] is not None, loc.uri


def test_a_rank_whose_checkpoint_write_hangs_exits_instead_of_hanging_the_job(job, tmp_path):
    """checkpoint.stuck_write_s under torchrun: rank 0's background write of step 4 hangs
    (the drill would hold it 15 minutes). Its upload gives the write up after 1 s without
    a byte, the main thread raises that at the next checkpoint, and the rank leaves at
    once: its hung writer thread would block a normal interpreter exit, and torchrun would
    never see the rank fail. The job fails with the one-line cause; nothing of step 4
    looks complete in storage."""
    from tests.support.torchrun import torchrun_command
    from trainer.checkpoint import manager as ckpt_mod

    release = tmp_path / "release"
    path = job("hang", checkpoint={"every_steps": 4, "stuck_write_s": 1})
    cmd, env = torchrun_command(["-m", "trainer", "run", str(path)])
    env["RAYLIFT_FAULT_HOLD_WRITE"] = f"4:{release}"
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a hung job's ranks can be killed with it
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, stderr[-3000:]
    assert release.with_name("release.write.r0").exists()  # the drill did hold it
    assert "error: CheckpointStuck: the checkpoint of step 4: " in stderr, stderr[-3000:]
    run = resolve(str(tmp_path / "runs")).join("hang")
    assert ckpt_mod.completeness(run.join(ckpt_mod.dir_name(4)))[0] is None


def test_torchrun_bad_config_is_one_line(job):
    res = torchrun(job("bad"), "train.micro_batch_size=zero")
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert lines and all("train.micro_batch_size" in x for x in lines), res.stderr[-2000:]


def test_as_test_runs_one_step_and_leaves_nothing_behind(job, tmp_path):
    res = torchrun(job("astest"), "train.as_test=true")
    assert res.returncode == 0, res.stderr[-8000:]
    assert "step 1/1 loss" in res.stderr
    assert not list((tmp_path / "runs" / "astest").glob("step_*"))
    assert not (tmp_path / "runs" / "astest" / "metrics.jsonl").exists()


def test_model_from_s3_is_downloaded_once_per_node(job, tiny, s3_server, tmp_path, monkeypatch):
    client = s3_server["client"]
    for f in tiny["model"].iterdir():
        client.upload_file(str(f), "ckpt", f"models/tiny/{f.name}")
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("RAYLIFT_MODEL_CACHE", str(cache))
    res = torchrun(
        job("s3model"),
        "model.path=s3://ckpt/models/tiny",
        f"storage.endpoint_override={s3_server['endpoint']}",
        "storage.path=s3://ckpt/runs-s3model",
        "train.max_steps=4",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # Two ranks on one node: exactly one of them downloads, the other waits for its copy.
    downloads = [x for x in res.stderr.splitlines() if "downloading s3://ckpt/models/tiny" in x]
    assert len(downloads) == 1, downloads
    copies = list(cache.iterdir())
    dirs = [p for p in copies if p.is_dir()]
    assert len(dirs) == 1 and (dirs[0] / ".raylift-complete").exists()
    assert (dirs[0] / "model.safetensors").stat().st_size == (
        tiny["model"] / "model.safetensors"
    ).stat().st_size
