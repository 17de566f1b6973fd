"""The pieces of fault tolerance that need no cluster: the retrying checkpoint upload, the
run journal, failure causes, and the elastic-scaling config."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from trainer.checkpoint.manager import completeness, write_manifest
from trainer.checkpoint.upload import upload_checkpoint
from trainer.config import JobConfig
from trainer.resilience import journal
from trainer.storage.location import Location, resolve
from trainer.storage.retry import UploadError, is_transient


class FlakyHandler(pafs.FileSystemHandler):
    """A local filesystem whose writes fail with `error` while `failures` lasts, and that
    records the order in which files were written."""

    def __init__(self, failures: int, error: str):
        self.fs = pafs.LocalFileSystem()
        self.failures = failures
        self.error = error
        self.written: list[str] = []

    def open_output_stream(self, path, metadata):
        if self.failures > 0:
            self.failures -= 1
            raise OSError(self.error)
        self.written.append(path)
        return self.fs.open_output_stream(path)

    # Everything else is the local filesystem's.
    def get_type_name(self):
        return "flaky"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path)


def _checkpoint(root: Path) -> Path:
    out = root / "src"
    (out / "strategy").mkdir(parents=True)
    (out / "strategy" / "model.pt").write_bytes(b"m" * 5000)
    (out / "scheduler.pt").write_bytes(b"s" * 10)
    (out / "trainer_state.json").write_text(json.dumps({"world_size": 1, "step": 4}))
    write_manifest(out, 0, before=set())
    return out


def test_upload_writes_manifests_last_and_retries_transient_errors(tmp_path):
    src = _checkpoint(tmp_path)
    handler = FlakyHandler(failures=2, error="AWS Error SLOW_DOWN (HTTP 503): Please reduce")
    fs = pafs.PyFileSystem(handler)
    dest = tmp_path / "dest" / "step_00000004"
    retries: list[int] = []
    attempts = upload_checkpoint(
        src, Location(fs, str(dest), str(dest)), 30, lambda n, e: retries.append(n)
    )
    assert attempts == 3 and retries == [1, 2]
    names = [Path(p).relative_to(dest).as_posix() for p in handler.written]
    assert names[-1] == "done/rank_0.json" and len(names) == 4
    state, why = completeness(resolve(str(dest)))
    assert state is not None, why


def test_upload_permanent_error_fails_at_once_in_one_line(tmp_path):
    src = _checkpoint(tmp_path)
    handler = FlakyHandler(failures=100, error="AWS Error ACCESS_DENIED: AccessDenied")
    dest = tmp_path / "dest" / "step_00000004"
    t0 = time.monotonic()
    with pytest.raises(UploadError, match=r"failed: AWS Error ACCESS_DENIED") as err:
        upload_checkpoint(src, Location(pafs.PyFileSystem(handler), str(dest), str(dest)), 30)
    assert time.monotonic() - t0 < 15 and "\n" not in str(err.value)
    assert handler.failures == 99  # tried once


def test_upload_gives_up_after_the_retry_budget(tmp_path):
    src = _checkpoint(tmp_path)
    handler = FlakyHandler(failures=10_000, error="Connection refused")
    dest = tmp_path / "dest" / "step_00000004"
    with pytest.raises(UploadError, match=r"still failing after 2 s of retries"):
        upload_checkpoint(src, Location(pafs.PyFileSystem(handler), str(dest), str(dest)), 2)
    assert completeness(resolve(str(dest)))[0] is None  # nothing recorded as complete


def test_transient_vs_permanent():
    assert is_transient(OSError("When uploading part: AWS Error NETWORK_CONNECTION"))
    assert is_transient(OSError("HTTP 503 SlowDown"))
    assert not is_transient(OSError("AccessDenied"))
    assert not is_transient(OSError("[Errno 28] No space left on device"))
    assert not is_transient(ValueError("bad"))
    # What storage answered about a path is no failure to reach it: no retry for minutes.
    assert not is_transient(FileNotFoundError("Path does not exist 'ckpt/run/x'"))
    assert not is_transient(NotADirectoryError("not a directory"))


def test_resume_lookup_waits_out_an_s3_outage(tmp_path, s3_server, caplog):
    """A new attempt that starts while object storage is down (the worker group restarted
    during an outage) retries its listing like an upload does, and resumes from the
    newest complete checkpoint once storage is back, instead of failing the run."""
    import logging
    import threading

    from trainer.runtime.worker import Runtime

    run = resolve(f"s3://{s3_server['bucket']}/lookup-outage", s3_server["endpoint"])
    upload_checkpoint(_checkpoint(tmp_path), run.join("step_00000004"), 30)
    rt = Runtime()
    rt.run, rt.retry_s = run, 120.0
    tried = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "failed (try 1)" in record.getMessage():
                tried.set()

    seen = Seen()
    logging.getLogger("trainer.storage.retry").addHandler(seen)
    got: list[Any] = []
    server = s3_server["server"]
    server.stop()
    try:
        lookup = threading.Thread(target=lambda: got.append(rt._from_storage()), daemon=True)
        lookup.start()
        deadline = time.monotonic() + 120
        while not tried.wait(0.1):  # its first try failed, and it is retrying
            assert lookup.is_alive(), "the lookup gave up while storage was down"
            assert time.monotonic() < deadline, "the lookup never tried storage"
        assert not got  # still waiting for storage, not failed
    finally:
        server.start()
        logging.getLogger("trainer.storage.retry").removeHandler(seen)
    lookup.join(120)
    assert got and got[0] is not None, got
    assert json.loads((got[0] / "trainer_state.json").read_text())["step"] == 4
    rt.release_fetched()


def test_journal_merges_writers_and_summarizes(tmp_path):
    run = resolve(str(tmp_path / "run"))
    a = journal.Journal(run, "attempt-1-rank0")
    c = journal.Journal(run, "controller-1")
    a.add("attempt", attempt=1, world_size=2, from_step=0, lost_steps=0, lost_s=None)
    a.add("checkpoint", step=25, kind="periodic", save_s=0.5, upload_s=2.0)
    c.add("failure", cause="worker_died", ranks=[1], message="killed")
    b = journal.Journal(run, "attempt-2-rank0")
    b.add("attempt", attempt=2, world_size=1, from_step=25, lost_steps=7, lost_s=21.5)
    b.add("upload_retry", step=50, attempt=1, error="503")
    b.add("checkpoint", step=50, kind="emergency", save_s=1.5, upload_s=4.0)
    b.add("preemption", step=50, deadline_s=100.0, save_s=5.5, margin_s=94.5)
    b.add("stopped", step=60)
    d = journal.Journal(run, "attempt-3-rank0")  # a resubmission after the clean stop
    d.add("attempt", attempt=3, after="stop", world_size=2, from_step=60, lost_steps=0)
    d.add("finished", step=80)
    (run.path and Path(run.path) / "journal" / "attempt-2-rank0.jsonl").open("a").write("{torn")
    records = journal.read(run)
    assert [r["event"] for r in records][:3] == ["attempt", "checkpoint", "failure"]
    s = journal.summarize(records)
    assert s["attempts"] == 3 and s["restarts"] == 1  # the clean resubmission is no restart
    assert s["failures"] == {"worker_died": 1} and s["lost_steps"] == [7]
    assert s["lost_s"] == 21.5 and s["upload_retries"] == 1 and s["finished"]
    assert s["mean_save_s"] == 1.0 and s["mean_upload_s"] == 3.0
    assert s["preemptions"] == [{"step": 50, "deadline_s": 100.0, "save_s": 5.5, "margin_s": 94.5}]


def test_journal_written_during_an_outage_is_written_once_storage_answers(tmp_path):
    """A rank's upload retry is journaled while storage is away: the write fails (a
    warning, training goes on), the record stays, and flush writes it once storage is
    back; a flush with nothing unwritten writes nothing."""
    run = resolve(str(tmp_path / "run"))
    Path(run.path).mkdir(parents=True)
    blocker = Path(run.path) / journal.JOURNAL_DIR
    blocker.write_text("not a folder")  # storage refuses the journal's folder
    j = journal.Journal(run, "attempt-1-rank1")
    j.add("upload_retry", step=50, attempt=1, error="connection refused")
    assert j.unwritten and journal.read(run) == []
    blocker.unlink()
    j.flush()
    assert not j.unwritten
    assert journal.summarize(journal.read(run))["upload_retries"] == 1
    (Path(run.path) / journal.JOURNAL_DIR / "attempt-1-rank1.jsonl").unlink()
    j.flush()  # written already: not again
    assert journal.read(run) == []


def test_failure_causes_from_ray_errors():
    from ray.exceptions import RayActorError

    from trainer.resilience.callbacks import failure_cause

    class Preempted(RayActorError):
        @property
        def preempted(self) -> bool:
            return True

    assert failure_cause(Preempted()) == "preempted"
    died = RayActorError(error_msg="The actor is dead because its node has died. Node Id: ab")
    assert failure_cause(died) == "node_lost"
    proc = RayActorError(error_msg="The actor is dead because its worker process has died.")
    assert failure_cause(proc) == "worker_died"
    assert failure_cause(ValueError("loss is nan")) == "error"
    # gloo on the surviving rank when its peer's node was killed: closed, or a read timeout
    # when the socket never saw the close (a CI run classified this as "error").
    for gloo in (
        "[pair.cc:538] Connection closed by peer [127.0.0.1]:4242",
        "[pair.cc:598] Read timeout [127.0.0.1]:4242 This is typically caused by a remote"
        " worker hanging or bugs in the application.",
    ):
        assert failure_cause(RuntimeError(gloo)) == "worker_died", gloo


BASE = {
    "model": {"path": "m"},
    "data": {"train_file": "x.jsonl"},
    "run": {"name": "r"},
    "train": {"max_steps": 5, "micro_batch_size": 4},
}


def test_elastic_keeps_the_global_batch_and_refuses_sizes_that_cannot():
    base = {**BASE, "train": {**BASE["train"], "grad_accum": 2}}
    cfg = JobConfig.model_validate({**base, "scaling": {"num_workers": [1, 2]}})
    assert cfg.scaling.elastic and cfg.global_batch == 16
    assert [cfg.grad_accum_for(w) for w in (1, 2)] == [4, 2]
    with pytest.raises(ValueError, match=r"cannot be kept on 3 worker\(s\)"):
        JobConfig.model_validate({**BASE, "scaling": {"num_workers": [2, 4]}})
    with pytest.raises(ValueError, match=r"needs strategy ddp or fsdp"):
        JobConfig.model_validate(
            {**BASE, "scaling": {"num_workers": [1, 2]}, "strategy": {"name": "deepspeed"}}
        )
    with pytest.raises(ValueError, match=r"1 <= min <= max"):
        JobConfig.model_validate({**BASE, "scaling": {"num_workers": [3, 2]}})
    assert (
        JobConfig.model_validate({**BASE, "scaling": {"num_workers": [2, 2]}}).scaling.num_workers
        == 2
    )


def test_retrying_filesystem_survives_a_blip_in_ray_style_writes_and_reads(tmp_path):
    """What Ray Train's controller does with its storage (write a small state file, list,
    read it back) goes through the wrapper; a blip during the write is retried whole."""
    import pickle

    from trainer.storage.retry import retrying

    handler = FlakyHandler(failures=2, error="Could not connect to server")
    fs = retrying(pafs.PyFileSystem(handler), retry_s=30)
    path = str(tmp_path / "run" / "checkpoint_manager_snapshot.json")
    fs.create_dir(str(tmp_path / "run"))
    with fs.open_output_stream(path) as f:
        f.write(b'{"checkpoints": [1, 2]}')
    assert handler.failures == 0 and handler.written == [path]
    with fs.open_input_stream(path) as f:
        assert json.loads(f.read()) == {"checkpoints": [1, 2]}
    infos = fs.get_file_info(pafs.FileSelector(str(tmp_path / "run")))
    assert [i.base_name for i in infos] == ["checkpoint_manager_snapshot.json"]
    # Ray ships the filesystem to its controller and workers, and compares what comes
    # back with its own: it must pickle, and compare by value.
    plain = retrying(pafs.LocalFileSystem(), retry_s=30)
    assert pickle.loads(pickle.dumps(plain)).equals(plain)
    assert not plain.equals(retrying(pafs.LocalFileSystem(), retry_s=5))
    permanent = FlakyHandler(failures=1, error="AccessDenied")
    fs2 = retrying(pafs.PyFileSystem(permanent), retry_s=30)
    with pytest.raises(OSError, match="AccessDenied"), fs2.open_output_stream(path) as f:
        f.write(b"x")


def test_fault_hold_stops_an_upload_before_its_manifests_until_released(tmp_path, monkeypatch):
    """The drill that lets the fault tests land a kill or an outage inside the upload
    window: the held upload has its data files but no manifests (so it is not complete)
    until the release file appears; a checkpoint of another step is never held."""
    import threading

    from trainer import faults

    release = tmp_path / "release"
    monkeypatch.setenv("RAYLIFT_FAULT_HOLD", f"4:{release}")
    src = _checkpoint(tmp_path)
    other = tmp_path / "dest" / "step_00000008"
    upload_checkpoint(src, resolve(str(other)), 30, None, lambda: faults.hold(8, "upload", 0))
    assert completeness(resolve(str(other)))[0] is not None

    dest = tmp_path / "dest" / "step_00000004"
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (
            upload_checkpoint(
                src, resolve(str(dest)), 30, None, lambda: faults.hold(4, "upload", 0)
            ),
            done.set(),
        )
    )
    thread.start()
    marker = tmp_path / "release.upload.r0"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "the upload never reached its hold"
    assert (dest / "trainer_state.json").exists() and not (dest / "done").exists()
    assert completeness(resolve(str(dest)))[0] is None and not done.is_set()
    release.touch()
    thread.join(timeout=60)
    assert done.is_set() and completeness(resolve(str(dest)))[0] is not None


def test_a_stopped_s3_server_leaves_no_sockets_in_tmp(tmp_path):
    """weed makes unix sockets in /tmp for its ports; stopping the test server removes
    them, so CI runs do not pile them up on the machine."""
    from tests.support.s3 import WeedServer

    server = WeedServer(tmp_path)
    server.start()
    try:
        made = server.sockets()
        assert any(p.name.startswith("seaweedfs-s3-") for p in made), made
    finally:
        server.stop()
    assert server.sockets() == [] and not any(p.exists() for p in made)


def test_prepared_uploads_parse_no_sdk_model_during_training(tmp_path, s3_server, monkeypatch):
    """The runtimes call `prepare_uploads` before the first step, so the first
    checkpoint's upload (a background thread during training) no longer parses botocore's
    endpoint and S3 models while holding the GIL the training thread needs."""
    from botocore.loaders import JSONFileLoader

    from trainer.storage import transfer as upload

    monkeypatch.setattr(upload, "_s3_clients", {})  # this process's first client
    loc = resolve("s3://ckpt/prepared", s3_server["endpoint"])
    upload.prepare_uploads(loc)
    parsed: list[str] = []
    load = JSONFileLoader.load_file
    monkeypatch.setattr(
        JSONFileLoader, "load_file", lambda self, path: parsed.append(path) or load(self, path)
    )
    src = tmp_path / "part.bin"
    src.write_bytes(b"x" * 4096)
    upload.put_files_s3([(src, "part.bin")], loc)
    head = s3_server["client"].head_object(Bucket="ckpt", Key="prepared/part.bin")
    assert head["ContentLength"] == 4096
    assert parsed == []


def test_lost_steps_count_from_the_ram_tiers_newest_snapshot_past_the_written_history(tmp_path):
    """On S3 the metrics a hard kill took with it end before the kill (rewritten every few
    seconds and at checkpoints); a step that some keeper held was trained, so the next
    attempt counts its lost steps from there."""
    from types import SimpleNamespace

    from trainer.resilience.attempt import _journal_attempt

    run = resolve(str(tmp_path / "run"))
    journal.Journal(run, "attempt-1-rank0").add("attempt", attempt=1, from_step=0, lost_steps=0)
    history = [{"event": "train", "step": s, "time": 1000.0 + s} for s in range(1, 11)]
    rt = SimpleNamespace(journal=journal.Journal(run, "attempt-2-rank0"), run=run, world_size=2)
    # The RAM tier restored step 16; the newest snapshot a keeper held was of step 18.
    _journal_attempt(rt, 2, history, 16, "memory-own", trained_to=18)
    # A restore from storage's step 10 with nothing known past the history: none lost.
    rt.journal = journal.Journal(run, "attempt-3-rank0")
    _journal_attempt(rt, 3, history, 10, "storage")
    got = {r["source"]: r for r in journal.read(run) if r["event"] == "attempt"}
    assert got["attempt-2-rank0"]["after"] == "failure"
    assert got["attempt-2-rank0"]["lost_steps"] == 2
    assert got["attempt-3-rank0"]["lost_steps"] == 0


def test_a_step_lost_to_an_earlier_fault_is_not_counted_again(tmp_path):
    """Killed after step 15, resumed from 5, killed after 12, resumed from 10: the second
    attempt lost 10 steps, the third 2 (not 15 - 10: steps 13-15 were lost already)."""
    from types import SimpleNamespace

    from trainer.resilience.attempt import _journal_attempt

    run = resolve(str(tmp_path / "run"))
    journal.Journal(run, "attempt-1-rank0").add("attempt", attempt=1, from_step=0, lost_steps=0)
    history = [
        {"event": "train", "attempt": 1, "step": s, "time": 1000.0 + s} for s in range(1, 16)
    ]
    rt = SimpleNamespace(journal=journal.Journal(run, "attempt-2-rank0"), run=run, world_size=2)
    _journal_attempt(rt, 2, history, 5, "memory-own")
    history += [{"event": "resume", "attempt": 2, "from_step": 5}]
    history += [
        {"event": "train", "attempt": 2, "step": s, "time": 2000.0 + s} for s in range(6, 13)
    ]
    rt.journal = journal.Journal(run, "attempt-3-rank0")
    _journal_attempt(rt, 3, history, 10, "memory-buddy")
    got = {r["source"]: r["lost_steps"] for r in journal.read(run) if r["event"] == "attempt"}
    assert got["attempt-2-rank0"] == 10 and got["attempt-3-rank0"] == 2
