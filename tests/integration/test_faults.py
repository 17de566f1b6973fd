"""Fault injection on real processes: SIGKILLed workers, a killed node, a kill while a
checkpoint is being written, a spot preemption (a node drain with a deadline), and an S3
outage during an upload. Every run trains the same 150 steps (checkpoint every 25) as one
uninterrupted reference run, and must end with the same weights: a fault may cost time
and at most one interval of steps (two while an upload is in flight; zero on a
preemption), never correctness."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.support.background import BackgroundRun
from tests.support.jobs import base_job
from tests.support.ray_jobs import history, launch, train_workers, wait_for
from tools.jobcli import submit
from tools.jobcli.client import client_for
from tools.jobcli.follow import follow
from tools.jobcli.main import main
from trainer.checkpoint import manager as ckpt_mod
from trainer.config import load_config
from trainer.observability.metrics import read_records
from trainer.observability.steps import REPORT_EVERY_S
from trainer.resilience import journal
from trainer.storage.location import download_dir, resolve

pytestmark = pytest.mark.slow

STEPS, EVERY = 150, 25
FINAL = f"export/{ckpt_mod.dir_name(STEPS)}/model/model.safetensors"


def fault_job(tiny: dict[str, Path], root: Path, name: str, **sections: dict[str, Any]) -> Path:
    data = base_job(tiny, root / "runs", name)
    data["train"].update({"max_steps": STEPS, "eval_every": None, "log_every": 1})
    data["checkpoint"].update({"every_steps": EVERY, "keep_last": 2})
    data["run"].update({"max_failures": 5})
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Reference:
    """The uninterrupted run every fault run must reproduce. It runs under torchrun: the
    same loop, world size and gloo reductions as on Ray Train (test_ray_train's exact
    resume takes one run through both and gets the same weights), without a Ray job's
    ~30 CPU-seconds of start-up on the CI machine. It starts in the background with the
    file's first test and trains while that test's Ray job starts up; `ref["weights"]` and
    `ref["losses"]` wait for it (issue 56)."""

    def __init__(self, path: Path) -> None:
        self.path, self.run = path, BackgroundRun(path)
        self._got: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if not self._got:
            self.run.wait()
            cfg = submit.absolutize(load_config(self.path, []), Path.cwd())
            run_dir = Path(cfg.storage.path) / cfg.run.name
            self._got = {"weights": load_file(str(run_dir / FINAL)), "losses": _losses(cfg)}
        return self._got[key]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    ref = Reference(fault_job(tiny, tmp_path_factory.mktemp("faultref"), "fault-ref"))
    try:
        yield ref
    finally:
        ref.run.stop()


def _losses(cfg: Any) -> list[float]:
    return [r["loss"] for r in history(cfg)[1]]


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=k)


def _train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(resolve(str(run_dir)).join("metrics.jsonl")) if "step" in r]


def _held(release: Path, *what: str, ranks: int = 2) -> bool:
    """Whether every rank's named holders of the RAYLIFT_FAULT_HOLD drill are waiting."""
    return all(
        release.with_name(f"{release.name}.{w}.r{r}").exists() for w in what for r in range(ranks)
    )


def _finish(client: Any, job_id: str) -> None:
    status, _ = follow(client, job_id, progress=False)
    assert status == "SUCCEEDED", client.get_job_logs(job_id)[-5000:]


def test_three_worker_kills_mid_upload_mid_write_and_at_random_resume_exactly(
    ray_cluster, tiny, tmp_path, reference
):
    """SIGKILL a training worker three times in one run.

    1. While step 50's checkpoint is being uploaded: the upload is held between the data
       files and the manifests (the fault-injection pause), so that folder is torn; it is
       skipped with a warning and step 25 is resumed.
    2. While step 75's checkpoint is being written in the background (trainer.storage.staging
       copies the state to host memory, a thread writes it; held before its manifest):
       training goes on past it meanwhile (the stall is only the copy), nothing of step 75
       looks complete, and killing the writing rank resumes from step 50.
    3. At a random step: the newest complete checkpoint is resumed.

    No restart loses more than two intervals (one may still be uploading), nothing torn
    is ever loaded, and the final weights equal the uninterrupted run's. (Two scenarios
    in one job: each Ray job costs the CI machine ~30 CPU-seconds of start-up.)"""
    rng = random.Random(20261122)
    path = fault_job(tiny, tmp_path, "kill3")
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    torn, release = 2 * EVERY, tmp_path / "release"
    held, release_write = 3 * EVERY, tmp_path / "release-write"
    client, job_id = submit.submit(
        cfg,
        ray_cluster.dashboard_url,
        env_vars={
            "RAYLIFT_FAULT_HOLD": f"{torn}:{release}",
            "RAYLIFT_FAULT_HOLD_WRITE": f"{held}:{release_write}",
        },
    )
    run_dir = Path(cfg.storage.path) / cfg.run.name
    run = resolve(str(run_dir))

    # 1. The step-50 upload stops between its data files and its manifests, and training
    # stops after step 50, until the test releases both: the kill lands inside that window
    # however slowly this machine polls.
    wait_for(lambda: _held(release, "upload", "train"), "step 50 held mid-upload", client, job_id)
    folder = run_dir / ckpt_mod.dir_name(torn)
    assert (folder / "strategy").exists() and not (folder / "done").exists()
    # Rank 0 writes the checkpoint: kill it inside the held upload.
    os.kill(train_workers(client, job_id)[0].pid, signal.SIGKILL)
    release.touch()  # the restarted group trains through step 50 without a hold

    # 2. DDP: rank 0 writes the model and optimizer; its background write of step 75
    # holds while training goes on.
    wait_for(lambda: _held(release_write, "write", ranks=1), "step 75's write held", client, job_id)

    def trained_past() -> bool:
        return any(r.get("attempt") == 2 and r["step"] >= held + 3 for r in _train_records(run_dir))

    wait_for(trained_past, "steps trained during the held write", client, job_id)
    assert ckpt_mod.completeness(run.join(ckpt_mod.dir_name(held)))[0] is None
    os.kill(train_workers(client, job_id)[0].pid, signal.SIGKILL)
    release_write.touch()

    # 3. A random step of the third attempt.
    target = 110 + rng.randint(0, 12)

    def reached() -> bool:
        return any(r.get("attempt") == 3 and r["step"] >= target for r in _train_records(run_dir))

    wait_for(reached, f"attempt 3 at step {target}", client, job_id)
    newest = ckpt_mod.find_latest(run, allow_scratch=True)
    at_kill = ckpt_mod.step_of(newest) if newest else 0
    victims = train_workers(client, job_id)
    assert len(victims) == 2, victims
    os.kill(victims[rng.randrange(2)].pid, signal.SIGKILL)
    _finish(client, job_id)

    records, steps, wasted = history(cfg)
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert len(resumes) == 3
    assert resumes[0]["from_step"] == torn - EVERY, (resumes, torn)
    assert ckpt_mod.dir_name(torn) not in str(resumes[0]["checkpoint"])
    logs = client.get_job_logs(job_id)
    assert f"checkpoint {run_dir / ckpt_mod.dir_name(torn)} is incomplete" in logs
    assert resumes[1]["from_step"] == held - EVERY, (resumes, held)
    # Never older than what was complete when the worker died (a checkpoint whose upload
    # the survivor finished just after the kill may be newer).
    assert at_kill <= resumes[2]["from_step"] <= at_kill + EVERY, (resumes, at_kill)

    summary = journal.summarize(journal.read(run))
    assert summary["restarts"] == 3 and summary["failures"] == {"worker_died": 3}, summary
    # A kill may land while the newest checkpoint is still uploading: what is lost is
    # bounded by one interval per upload in flight (checkpoint.max_uploads_in_flight, 1)
    # plus the interval being trained.
    assert all(0 <= lost <= 2 * EVERY for lost in summary["lost_steps"]), summary
    assert sum(summary["lost_steps"]) == wasted
    _same_weights(load_file(str(run_dir / FINAL)), reference["weights"], atol=1e-5)


@pytest.mark.bench_only
def test_a_hung_background_write_fails_the_attempt_which_resumes_from_the_last_checkpoint(
    ray_cluster, tiny, tmp_path
):
    """checkpoint.stuck_write_s: step 50's background write hangs (held before its
    manifest, adding no byte; the drill would hold it for 15 minutes). After 2 s without
    progress the upload gives it up: the attempt fails with a one-line cause naming the
    step, Ray restarts the group, and the run resumes from step 25 (the last complete
    checkpoint) and finishes, instead of leaving its workers idle behind a hung write.

    In make bench (issue 56: a Ray job and a restart, ~75 s of CI). CI still covers each
    part: test_torchrun's hung write (given up after stuck_write_s, the rank fails at once
    with the one-line cause naming the step, nothing of the step complete), the failure's
    cause "error" (tests/unit/resilience), and a failed attempt that Ray restarts from the
    newest complete checkpoint, a torn one skipped (this file's three kills)."""
    steps, held, release = 70, 2 * EVERY, tmp_path / "release"
    path = fault_job(
        tiny,
        tmp_path,
        "stuckwrite",
        train={"max_steps": steps},
        checkpoint={"stuck_write_s": 2},
    )
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    client, job_id = submit.submit(
        cfg,
        ray_cluster.dashboard_url,
        env_vars={"RAYLIFT_FAULT_HOLD_WRITE": f"{held}:{release}"},
    )
    run = resolve(str(Path(cfg.storage.path) / cfg.run.name))
    wait_for(lambda: _held(release, "write", ranks=1), "step 50's write held", client, job_id)
    since = time.monotonic()

    def failures() -> list[dict[str, Any]]:
        return [e for e in journal.read(run) if e["event"] == "failure"]

    (failure,) = wait_for(failures, "the hung write to fail the attempt", client, job_id, 180)
    # The 2 s limit plus Ray's polls and a loaded machine: far from the drill's 900 s.
    assert time.monotonic() - since < 120
    release.touch()  # the restarted attempt writes step 50 normally
    _finish(client, job_id)

    assert failure["cause"] == "error", failure
    assert "step 50" in failure["message"] and "stuck_write_s" in failure["message"], failure
    records, trained, _ = history(cfg)
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [held - EVERY]
    assert ckpt_mod.step_of(ckpt_mod.find_latest(run, allow_scratch=False)) == steps


def test_s3_outage_during_upload_is_retried_without_stopping_training(
    ray_cluster, tiny, tmp_path, s3_server, reference
):
    """The S3 server goes away while a checkpoint is being uploaded and comes back a few
    seconds later: the upload retries, training steps on meanwhile, no broken checkpoint
    is recorded, and the run completes with the reference weights."""
    path = fault_job(
        tiny,
        tmp_path,
        "outage",
        storage={
            "path": f"s3://{s3_server['bucket']}/runs",
            "endpoint_override": s3_server["endpoint"],
        },
        # Ample for an outage that ends three steps after it began; a run whose training
        # stops during the outage fails here in minutes, not at the 300 s default.
        checkpoint={"upload_retry_s": 150},
    )
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    held, release = 2 * EVERY, tmp_path / "release"
    client, job_id = submit.submit(
        cfg, ray_cluster.dashboard_url, env_vars={"RAYLIFT_FAULT_HOLD": f"{held}:{release}"}
    )
    # The step-50 upload stops before its manifests and training stops after step 50
    # until the release, so the outage starts while both are provably still pending. The
    # server comes back only once the log shows a failed upload try and three steps
    # trained after the release: the outage overlaps training by construction, not by
    # how fast this machine is.
    wait_for(lambda: _held(release, "upload", "train"), "step 50 held mid-upload", client, job_id)
    down_at = time.time()
    s3_server["server"].stop()
    # Held this long, the run's periodic metrics report to Ray is due at the first step
    # after the release. Ray hands reports over in order, behind the running upload: a
    # report made now would stop training until storage came back (it did, and the
    # upload then ran out of retries). Not a wait for an event: it makes the report due.
    time.sleep(REPORT_EVERY_S + 0.5)
    release.touch()
    run = resolve(cfg.storage.path, cfg.storage.endpoint_override).join(cfg.run.name)
    after = f"step {held + 3}/{STEPS} "
    retried = f"checkpoint upload to {run.join(ckpt_mod.dir_name(held)).uri} failed (try 1)"

    def trained_through_outage() -> bool:
        logs = client.get_job_logs(job_id)
        return after in logs and retried in logs

    try:
        wait_for(
            trained_through_outage, "steps and an upload retry during the outage", client, job_id
        )
    finally:
        # Back up whatever happened: the session's S3 server serves the tests after this one.
        s3_server["server"].start()
    up_at = time.time()
    _finish(client, job_id)

    records, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert not [r for r in records if r.get("event") == "resume"]  # never restarted
    stepped = [r["step"] for r in steps if down_at <= r["time"] <= up_at]
    assert set(range(held + 1, held + 4)) <= set(stepped), stepped
    summary = journal.summarize(journal.read(run))
    assert summary["upload_retries"] >= 1 and summary["restarts"] == 0, summary
    s3 = s3_server["client"]
    for _, loc in ckpt_mod.list_checkpoints(run):
        state, why = ckpt_mod.completeness(loc)
        if why == "empty":
            continue  # SeaweedFS keeps the folder of a pruned checkpoint; S3 would not
        listing = s3.list_objects_v2(Bucket="ckpt", Prefix=loc.path.split("/", 1)[1] + "/")
        assert state is not None, (loc.uri, why, [o["Key"] for o in listing.get("Contents", [])])
    local = download_dir(run.join("export"), tmp_path / "export")
    _same_weights(
        load_file(str(local / ckpt_mod.dir_name(STEPS) / "model" / "model.safetensors")),
        reference["weights"],
        atol=1e-5,
    )


# ---------------------------------------------------------------- nodes: lost, preempted
# These change the session cluster's nodes; each leaves a large_cpu_mem node and one
# plain 1-CPU node alive behind it, as the other tests expect.


def _plain_node(cluster: Any) -> Any:
    nodes = [n for n, labels in cluster.worker_nodes if labels.get("pool") == "cpu"]
    assert len(nodes) == 1, cluster.worker_nodes
    return nodes[0]


def test_node_loss_elastic_run_continues_on_fewer_workers_and_grows_back(
    ray_cluster, tiny, tmp_path, reference
):
    """num_workers [1, 2]: the node of rank 1 dies (raylet and workers); the run goes on
    with one worker at once (grad_accum doubles, the global batch and sample order are
    unchanged), then grows back to two when a replacement node joins."""
    path = fault_job(
        tiny,
        tmp_path,
        "elastic",
        scaling={"num_workers": [1, 2], "elastic_resize_interval_s": 2},
        checkpoint={"upload": "sync"},
    )
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    # Synchronous uploads held 2 s each stretch the run, so there is time to grow back.
    client, job_id = submit.submit(
        cfg, ray_cluster.dashboard_url, env_vars={"RAYLIFT_FAULT_UPLOAD_PAUSE_S": "2"}
    )
    run_dir = Path(cfg.storage.path) / cfg.run.name

    def attempt_at(attempt: int, step: int):
        return lambda: any(
            r.get("attempt") == attempt and r["step"] >= step for r in _train_records(run_dir)
        )

    wait_for(attempt_at(1, 35), "step 35 on two workers", client, job_id)
    ray_cluster.kill_node(_plain_node(ray_cluster))
    # Training goes on with one worker, without waiting for a replacement; then one joins.
    wait_for(attempt_at(2, 1), "a step on one worker", client, job_id)
    ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
    _finish(client, job_id)

    run = resolve(str(run_dir))
    _, steps, _ = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    attempts = [r for r in journal.read(run) if r["event"] == "attempt"]
    # Two workers, then one at once after the loss. Growing back when the replacement
    # joins depends on when Ray's resource view catches up (a standalone run showed
    # [2, 1, 2]; a loaded CI machine may finish first). Later attempts have one or two
    # workers: a loaded machine has also failed an attempt of one worker once more.
    sizes = [a["world_size"] for a in attempts]
    assert sizes[:2] == [2, 1] and set(sizes) <= {1, 2}, attempts
    assert all(a["lost_steps"] <= EVERY for a in attempts)
    failures = [r for r in journal.read(run) if r["event"] == "failure"]
    assert failures and failures[0]["cause"] in ("node_lost", "worker_died"), failures
    # The same global batches in the same order: the curve is the reference's up to the
    # floating-point order of a 1-worker vs 2-worker reduction.
    for want, got in zip(reference["losses"], [r["loss"] for r in steps], strict=True):
        assert got == pytest.approx(want, abs=2e-3)
    _same_weights(load_file(str(run_dir / FINAL)), reference["weights"], atol=1e-3)


def test_spot_notice_checkpoints_at_once_and_loses_no_step(ray_cluster, tiny, tmp_path, reference):
    """A spot notice served by a local IMDSv2 server: the node agent (the real one, as the
    image runs it) drains its node for preemption; the loop sees it at a step boundary,
    checkpoints at once and stops stepping; the node is reclaimed at the deadline, a
    replacement joins, and the run resumes from the emergency checkpoint: zero lost.

    The reclaim comes the moment the notice is journaled, and rank 1 (on the reclaimed
    node) uploads its share of every checkpoint 3 s after rank 0 (RAYLIFT_FAULT_UPLOAD_PAUSE_S
    3@1): a notice journaled before every rank's manifest is in storage leaves the
    emergency checkpoint torn, whatever the machine's speed (issue 56)."""
    from tests.support.imds import SPOT_PATH, TOKEN_PATH, FakeImds, node_agent

    cfg, client, job_id = launch(
        ray_cluster,
        fault_job(tiny, tmp_path, "spot"),
        env={"RAYLIFT_FAULT_UPLOAD_PAUSE_S": "3@1"},
    )
    run_dir = Path(cfg.storage.path) / cfg.run.name
    run = resolve(str(run_dir))
    victim = _plain_node(ray_cluster)
    with (
        FakeImds() as imds,
        node_agent(imds, victim.node_id, ray_cluster.address, tmp_path / "agent.log"),
    ):
        wait_for(
            lambda: any(r["step"] >= 10 for r in _train_records(run_dir)),
            "step 10",
            client,
            job_id,
        )
        imds.trigger_spot(25)  # the reclaim in 25 s; the agent drains with 15 s left
        notice = wait_for(
            lambda: [r for r in journal.read(run) if r["event"] == "preemption"],
            "the emergency checkpoint",
            client,
            job_id,
        )[0]
        ray_cluster.kill_node(victim)  # the reclaim
        ray_cluster.add_node(num_cpus=1, labels={"pool": "cpu"})  # the pool's replacement
        # IMDSv2: a session token first, and no metadata read without it.
        assert imds.requests[0].method == "PUT" and imds.requests[0].path == TOKEN_PATH
        assert imds.requests_to(SPOT_PATH) and all(r.token for r in imds.requests_to(SPOT_PATH))
    log_text = (tmp_path / "agent.log").read_text()
    assert f"drained Ray node {victim.node_id}: reason PREEMPTION" in log_text, log_text[-2000:]
    _finish(client, job_id)

    records, steps, wasted = history(cfg)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # What was lost and where each restart resumed from, not how many restarts it took: a
    # loaded CI's live node missed heartbeats and the group restarted twice, both times
    # from the emergency checkpoint, losing nothing.
    resumes = [r for r in records if r.get("event") == "resume"]
    assert resumes and all(r["from_step"] == notice["step"] for r in resumes), (resumes, notice)
    assert wasted == 0
    # Seen at a step boundary, saved at that step: the trained steps after the notice
    # are none, and the save fit the deadline with its margin recorded.
    first_attempt = [r["step"] for r in records if r.get("attempt") == 1 and "loss" in r]
    assert max(first_attempt) == notice["step"]
    assert notice["save_s"] < notice["deadline_s"] and notice["margin_s"] > 0, notice
    attempts = [r for r in journal.read(run) if r["event"] == "attempt"]
    assert len(attempts) >= 2 and all(a["lost_steps"] == 0 for a in attempts), attempts
    assert all(a["from_step"] == notice["step"] for a in attempts[1:]), (attempts, notice)
    _same_weights(load_file(str(run_dir / FINAL)), reference["weights"], atol=1e-5)
    assert json.loads((run_dir / "summary.json").read_text())["run"] == "spot"


# ---------------------------------------------------------------- head / driver loss


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_head_loss_resubmit_resumes_from_storage_and_leaves_a_finished_run_alone(
    tiny, tmp_path, reference, capsys
):
    """The whole cluster (head, driver and all) goes away mid-run. `submit.py run
    --resubmit` waits for a cluster at the same address, resubmits the run name and the
    run finishes from storage with the reference weights; a second --resubmit of the
    finished run submits nothing. (The cluster runs in a process of its own: Ray keeps one
    token per process, and the session's cluster lives in this one.)"""
    import secrets

    from tools.localcluster import free_port

    saved = os.environ.get("RAY_AUTH_TOKEN")
    token, port = secrets.token_hex(32), free_port()
    url = f"http://127.0.0.1:{port}"
    path = fault_job(tiny, tmp_path, "headloss")
    argv = ["run", str(path), "--resubmit", "--no-progress", "--address", url]
    nodes = [{"num_cpus": 1, "labels": {"large_cpu_mem": "true"}}, {"num_cpus": 1}]

    def cluster() -> subprocess.Popen:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.cluster_proc",
                json.dumps(nodes),
                json.dumps({"token": token, "dashboard_port": port}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = proc.stdout.readline()
        assert ready and json.loads(ready)["url"] == url, ready
        return proc

    def stop(proc: subprocess.Popen) -> None:
        proc.stdin.close()  # the cluster stops: head, job driver and workers
        proc.wait(timeout=120)

    first = cluster()
    second = None
    try:
        os.environ["RAY_AUTH_TOKEN"] = token
        cfg = submit.absolutize(load_config(path, []), Path.cwd())
        client, job_id = submit.submit(cfg, url)
        run = resolve(cfg.storage.path).join(cfg.run.name)

        def checkpointed() -> bool:
            newest = ckpt_mod.find_latest(run, allow_scratch=True)
            return newest is not None and ckpt_mod.step_of(newest) >= 2 * EVERY

        wait_for(checkpointed, "a checkpoint at step 50", client, job_id)
        stop(first)

        result: dict[str, int] = {}
        waiter = threading.Thread(target=lambda: result.update(rc=main(argv)), daemon=True)
        waiter.start()  # it waits for the cluster to come back
        said = f"waiting for the Ray cluster at {url}"
        early = {"out": "", "err": ""}

        def waiting() -> bool:
            got = capsys.readouterr()
            early["out"] += got.out
            early["err"] += got.err
            return said in early["err"] or not waiter.is_alive()

        deadline = time.monotonic() + 120
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert waiter.is_alive(), early  # it said it waits, and it does
        second = cluster()
        waiter.join(timeout=600)
        out = capsys.readouterr()
        out_out, out_err = early["out"] + out.out, early["err"] + out.err
        assert result.get("rc") == 0, out_out[-3000:] + out_err[-3000:]
        assert said in out_err

        records, steps, _ = history(cfg)
        resumes = [r for r in records if r.get("event") == "resume"]
        assert len(resumes) == 1 and resumes[0]["from_step"] >= 2 * EVERY, resumes
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        _same_weights(load_file(str(Path(run.path) / FINAL)), reference["weights"], atol=1e-5)

        jobs_before = len(client_for(url, token).list_jobs())
        rc = main(argv)
        out = capsys.readouterr()
        assert rc == 0 and "headloss already finished (step 150)" in out.out, out
        assert len(client_for(url, token).list_jobs()) == jobs_before
    finally:
        for proc in (second, first):
            if proc is not None and proc.poll() is None:
                stop(proc)
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = saved


def test_a_file_cut_off_by_a_storage_outage_is_an_error_not_a_silent_success(tmp_path):
    """pyarrow's copy_files returns as if a file were written when an S3 part upload fails
    mid-file (the error is only printed as the stream is destroyed), so a manifest could
    vouch for a file that never arrived. Raylift's put_file must raise instead, so the
    upload retries. The server is stopped between two parts of one file: the source is a
    pipe that the test feeds, so the outage lands mid-file by construction."""
    from tests.support.s3 import S3_KEY, S3_SECRET, WeedServer
    from trainer.checkpoint.upload import put_file

    (tmp_path / "weed").mkdir()
    server = WeedServer(tmp_path / "weed")
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = S3_KEY, S3_SECRET
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    part = os.urandom(16 << 20)  # above pyarrow's 10 MB part: the first part is sent

    def feed() -> None:
        with open(pipe, "wb") as w:
            w.write(part)
            w.flush()
            server.stop()
            w.write(part)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        loc = resolve("s3://ckpt/cut/optimizer.pt", server.endpoint)
        with pytest.raises(OSError, match="upload"):
            put_file(pipe, loc.fs, loc.path)
    finally:
        feeder.join(timeout=120)
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_an_s3_file_cut_off_mid_multipart_upload_raises_and_leaves_no_object(tmp_path):
    """The same guarantee for the S3 path checkpoints take (boto3's transfer manager, files
    and parts in parallel): the server is stopped once the first part's bytes are going
    out, from the transfer's own progress callback, so the outage lands mid-file by
    construction. The upload must raise an OSError naming the file, and once the server
    is back no object stands at the key (a multipart upload is never completed)."""
    from tests.support.s3 import S3_KEY, S3_SECRET, WeedServer
    from trainer.checkpoint.upload import put_files_s3

    (tmp_path / "weed").mkdir()
    server = WeedServer(tmp_path / "weed")
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = S3_KEY, S3_SECRET
    src = tmp_path / "optimizer.pt"
    src.write_bytes(os.urandom(48 << 20))  # three 16 MiB parts
    stopped = threading.Event()

    def cut(_: int) -> None:
        if not stopped.is_set():
            stopped.set()
            server.stop()

    try:
        loc = resolve("s3://ckpt/cut-s3", server.endpoint)
        with pytest.raises(OSError, match=r"S3 upload of s3://ckpt/cut-s3/optimizer.pt failed"):
            put_files_s3([(src, "optimizer.pt")], loc, on_progress=cut)
        assert stopped.is_set()
        server.start()
        listing = server.client.list_objects_v2(Bucket="ckpt", Prefix="cut-s3/")
        assert [o["Key"] for o in listing.get("Contents", [])] == []
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
