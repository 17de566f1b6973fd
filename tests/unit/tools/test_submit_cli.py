"""The job CLI's pieces that need no cluster: size presets, submission ids, the job's
environment, finding the cluster, reading a run's progress, judging doctor's answer."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml
from ray.dashboard.modules.job.pydantic_models import JobDetails, JobType
from ray.job_submission import JobStatus

from tools.jobcli import cluster, doctor, follow, runs, submit
from tools.jobcli.main import main
from tools.jobcli.presets import preset_overrides
from trainer.config import load_config
from trainer.errors import UserError

BASE = {
    "model": {"path": "/models/llama"},
    "data": {"train_file": "/data/train.jsonl"},
    "train": {"max_steps": 100},
    "run": {"name": "r"},
}


def _cfg(tmp_path: Path, data: dict, size: str, overrides: list[str] | None = None):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    overrides = overrides or []
    return load_config(path, preset_overrides(size, path, overrides) + overrides)


def test_size_presets_fill_only_what_the_config_leaves_out(tmp_path):
    cfg = _cfg(tmp_path, BASE, "70b")
    assert (cfg.train.micro_batch_size, cfg.scaling.num_workers) == (8, 32)
    assert cfg.strategy.name == "deepspeed" and cfg.strategy.config == "zero3_offload"
    assert cfg.scaling.use_gpu and cfg.train.precision == "bf16"
    for size in ("7b", "13b"):
        cfg = _cfg(tmp_path, BASE, size)
        assert (cfg.train.micro_batch_size, cfg.scaling.num_workers) == (16, 16)

    mine = {**BASE, "train": {"max_steps": 100, "micro_batch_size": 2}, "strategy": "fsdp"}
    cfg = _cfg(tmp_path, mine, "7b", ["scaling.num_workers=4"])
    assert (cfg.train.micro_batch_size, cfg.scaling.num_workers) == (2, 4)
    assert cfg.strategy.name == "fsdp"  # the config's strategy wins, whole
    cfg = _cfg(tmp_path, {**BASE, "strategy": {"name": "deepspeed"}}, "13b")
    assert cfg.strategy.config == "zero3_offload"  # a deepspeed without its JSON gets it
    cfg = _cfg(tmp_path, {**BASE, "strategy": {"name": "deepspeed", "config": "zero2"}}, "7b")
    assert cfg.strategy.config == "zero2"


def _job(sid: str, status: str, run: str | None = "r", start: int = 0) -> JobDetails:
    return JobDetails(
        type=JobType.SUBMISSION,
        submission_id=sid,
        status=JobStatus(status),
        entrypoint="x",
        start_time=start,
        metadata={} if run is None else {runs.RUN_KEY: run},
    )


def test_submission_ids_count_per_run_and_only_live_ones_block():
    jobs = [
        _job("raylift-r-1", "FAILED", start=1),
        _job("raylift-r-2", "STOPPED", start=2),
        _job("raylift-r-x-1", "RUNNING", run="r-x", start=3),  # another run, same prefix
        _job("other", "RUNNING", run=None, start=4),
    ]
    mine = runs.submissions(jobs, "r")
    assert [j.submission_id for j in mine] == ["raylift-r-1", "raylift-r-2"]
    assert runs.next_submission_id(mine, "r") == "raylift-r-3"
    assert runs.live(mine) is None  # finished submissions: resubmitting resumes
    assert runs.live(runs.submissions(jobs, "r-x")).submission_id == "raylift-r-x-1"
    assert runs.next_submission_id([], "new") == "raylift-new-1"
    assert list(runs.by_run(jobs)) == ["r", "r-x"]


def test_job_env_passes_what_the_user_names_and_credentials_only_for_an_endpoint(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    plain = load_config(BASE)
    env = submit.job_env(plain, ["FI_TCP_IFACE=ens5", "NCCL_DEBUG", "A=b=c"])
    assert env == {
        "PYTHONUNBUFFERED": "1",
        "FI_TCP_IFACE": "ens5",
        "NCCL_DEBUG": "INFO",
        "A": "b=c",
    }
    on_aws = load_config({**BASE, "storage": {"path": "s3://bucket/runs"}})
    assert "AWS_SECRET_ACCESS_KEY" not in submit.job_env(on_aws)  # the nodes' IAM role
    minio = load_config(
        {**BASE, "storage": {"path": "s3://b/runs", "endpoint_override": "http://127.0.0.1:1"}}
    )
    assert submit.job_env(minio)["AWS_SECRET_ACCESS_KEY"] == "secret"
    with pytest.raises(UserError, match="--env NOT_SET_HERE: not set in this shell"):
        submit.job_env(plain, ["NOT_SET_HERE"])
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        submit.job_env(plain, ["1BAD=x"])


def test_cluster_address_order_and_the_local_cluster_file(tmp_path, monkeypatch, capsys):
    record = tmp_path / "localcluster.json"
    monkeypatch.setenv("RAYLIFT_LOCAL_CLUSTER_FILE", str(record))
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(UserError, match="no Ray cluster found"):
        cluster.resolve(None, contextlib.ExitStack())
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Ray cluster found") and err.count("\n") == 1

    token = tmp_path / "token"
    token.write_text("t0k\n")
    cluster.write_local_cluster_file("http://127.0.0.1:1234", token)  # this pid: alive
    found = cluster.resolve(None, contextlib.ExitStack())
    assert (found.address, found.token, found.local) == ("http://127.0.0.1:1234", "t0k", True)
    record.write_text(json.dumps({**json.loads(record.read_text()), "pid": 2**22 + 1}))
    with pytest.raises(UserError, match="no Ray cluster found"):
        cluster.resolve(
            None, contextlib.ExitStack()
        )  # its process is gone: a stale file is ignored

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:2")
    assert cluster.resolve(None, contextlib.ExitStack()).address == "http://127.0.0.1:2"
    given = cluster.resolve("http://127.0.0.1:3", contextlib.ExitStack())
    assert (given.address, given.local) == ("http://127.0.0.1:3", True)
    assert not cluster.resolve("http://10.0.0.5:8265", contextlib.ExitStack()).local


def test_port_forward_command_from_the_stack_is_parsed():
    command = (
        'aws ssm start-session --region eu-west-1 --target "$(aws ec2 describe-instances '
        "--region eu-west-1 --filters Name=tag:aws:autoscaling:groupName,Values=rl-head-1a2b "
        "Name=instance-state-name,Values=running --query 'Reservations[0].Instances[0]"
        "InstanceId' --output text)\" --document-name AWS-StartPortForwardingSession "
        '--parameters \'{"portNumber":["8265"],"localPortNumber":["8265"]}\''
    )
    assert cluster.parse_port_forward(command) == ("eu-west-1", "rl-head-1a2b", 8265)
    with pytest.raises(UserError, match="not in the expected form"):
        cluster.parse_port_forward("ssh head")


def test_progress_from_the_metrics_file(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    recs = [{"event": "train", "attempt": 1, "step": s, "loss": 5.0 - s / 10,
             "tokens_per_s": 100.0, "tokens_seen": 50 * s} for s in range(1, 7)]  # fmt: skip
    recs.append({"event": "resume", "attempt": 2, "from_step": 4})
    recs += [{"event": "train", "attempt": 2, "step": s, "loss": 1.0, "tokens_per_s": 200.0,
              "tokens_seen": 50 * s} for s in (5, 6, 7, 8)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    meta = {runs.RUN_KEY: "r", "raylift_storage": str(tmp_path / "runs")}
    p = runs.read_progress({**meta, "raylift_max_steps": "20"})
    assert (p.step, p.total, p.loss, p.tokens_per_s) == (8, 20, 1.0, 200.0)
    assert (p.restarts, p.lost_steps) == (1, 2)  # steps 5 and 6 of attempt 1 were lost
    assert p.eta_s == pytest.approx(12 * 50 / 200.0)
    assert runs.read_progress(meta, total=None).eta_s is None  # total unknown: no ETA
    assert runs.total_from_logs("x\nstep 3/40 loss 2.1 lr\nstep 4/40 loss 2.0 lr\n") == 40
    missing = runs.read_progress({**meta, runs.RUN_KEY: "nope"})
    assert missing.step is None and missing.note is None


def _node(node_id: str, torch_version: str, shared_ok: bool = True) -> dict:
    row = {"value": "ok", "ok": True}
    return {
        "node_id": node_id,
        "checks": {
            "python": {"value": "3.11.9", "ok": True},
            "torch": {"value": torch_version, "ok": True},
            "shared folder": {**row, "ok": shared_ok},
        },
    }


def test_doctor_marks_version_skew_red_on_every_node_and_counts_failures():
    result = {
        "nodes": [_node("a", "2.13.0"), _node("b", "2.13.0"), _node("c", "2.12.1", False)],
        "cluster": {"collective": {"value": "sum 6", "ok": True}},
    }
    doctor.judge(result)
    assert doctor.failures(result) == [
        ("a", "torch"),
        ("b", "torch"),
        ("c", "torch"),
        ("c", "shared folder"),
    ]
    assert "also 2.12.1" in result["nodes"][0]["checks"]["torch"]["detail"]
    same = {"nodes": [_node("a", "2.13.0"), _node("b", "2.13.0")], "cluster": {}}
    assert doctor.failures(doctor.judge(same)) == []
    assert doctor.parse(f"noise\n{doctor.MARK}{json.dumps(same)}\n") == same


def test_bare_config_means_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: config file not found" in capsys.readouterr().err


def test_logs_follow_stderr_as_it_is_now_not_as_it_was(tmp_path, monkeypatch):
    """setup_logging then a new stderr (a test capture ending, the CLI run twice in one
    process): records go to the stream of their own time, never to a closed earlier one.
    CI once failed on a '--- Logging error ---' traceback from exactly this."""
    import io
    import logging

    from trainer.observability.logs import setup_logging

    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    setup_logging()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    errors: list[str] = []
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, rec: errors.append("x"))
    logging.getLogger("raylift.submit").info("opening a forward to %s", "i-0abc")
    assert errors == [] and "opening a forward to i-0abc" in second.getvalue()


class _Tail:
    """The Jobs API's log tail, with the chunk boundaries Ray's own tail sends: it yields
    what the job's log file holds so far (ray.dashboard.modules.job.utils
    .file_tail_iterator), so a chunk can end inside a line the driver is still writing."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    async def tail_job_logs(self, job_id: str):
        for chunk in self.chunks:
            yield chunk


def _follow(chunks: list[str]):
    import asyncio

    return asyncio.run(follow._follow(_Tail(chunks), "raysubmit_x", progress=False))


def test_follow_finds_the_summary_cut_across_chunks_and_among_another_writers_text(capsys):
    """A fresh-clone CI run crashed in follow() with 'Extra data': Ray's log thread printed a
    worker's line into the driver's stdout between the summary's JSON and its newline."""
    from trainer.observability.logs import SUMMARY_MARK

    summary = {"steps": 4, "checkpoint": "s3://b/r/step_4", "losses": [3.2, 2.0]}
    line = SUMMARY_MARK + json.dumps(summary)
    cut = len(line) // 2
    chunks = [
        "step 1/4 loss 3.20\n" + line[:cut],
        line[cut:] + "(RayTrainWorker pid=9) saved\n\nstep 2/4 lo",
        "ss 2.00\n",
        "the last line, no newline",
    ]
    assert _follow(chunks) == summary
    assert capsys.readouterr().out.splitlines() == [
        "step 1/4 loss 3.20",
        "(RayTrainWorker pid=9) saved",
        "",
        "step 2/4 loss 2.00",
        "the last line, no newline",
    ]
    # The other order: a worker's line began before the summary and ended after it.
    assert _follow(["(RayTrainWorker pid=9) step " + line + "line\n"]) == summary
    assert capsys.readouterr().out == "(RayTrainWorker pid=9) step line\n"
    # A summary cut short (a driver killed while writing it) is no summary, and no crash.
    assert _follow(["x\n" + line[:cut] + "\n"]) is None
    assert capsys.readouterr().out == "x\n" + line[:cut] + "\n"


def test_marked_lines_are_one_write_and_doctor_finds_its_result_among_other_text():
    from trainer.observability.logs import print_marked
    from trainer.runtime.doctor import MARK

    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    result = {"nodes": [_node("a", "2.13.0")], "cluster": {}}
    stream = Stream()
    print_marked(MARK, result, stream)
    assert stream.writes == [MARK + json.dumps(result) + "\n"]
    mixed = f"noise\n(pid=3) a{MARK}{json.dumps(result)}(pid=4) b\n(pid=3) tail\n"
    assert doctor.parse(mixed) == result
