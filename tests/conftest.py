"""Shared fixtures: the tiny model, its tokenizer and data, job configs, a multi-node local
Ray cluster on 127.0.0.1, and a SeaweedFS S3 server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import file_order
from tests.support.jobs import ROOT, base_job, write_job
from tests.support.s3 import S3_KEY, S3_SECRET, WeedServer
from tests.support.slowest_files import TOP as TOP_FILES
from tests.support.slowest_files import FileTimes

# Everything the tests start (local Ray clusters, their job drivers and workers, torchrun)
# imports this checkout's code, not whatever the venv's editable install points at.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's timings, shortened for tests. `make bench` sets RAYLIFT_RAY_DEFAULTS=1 and keeps
# Ray's own values, which a production cluster runs with: a benchmark of Ray Train's
# per-step cost or of recovery time must not measure test-only polling rates.
if not os.environ.get("RAYLIFT_RAY_DEFAULTS"):
    # The controller polls its workers this often (Ray's default 2 s): a finished or failed
    # worker group is noticed sooner, which every one of the many short test runs pays.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # How often Ray Train looks for drained (preempted) nodes; its 5 s default suits a
    # two-minute spot notice, the fault tests give notices of seconds.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    # The GCS declares a node dead after missing health checks (30 s by Ray's defaults); the
    # node-loss tests kill raylets, and a real node loss is noticed faster than a slow test.
    # A killed raylet refuses the check at once, so five misses take ~5 s; a live node on a
    # loaded 2-core machine gets 2 s to answer each (at 1 s and 3 misses, a loaded CI saw a
    # live node declared dead in the middle of an elastic run).
    os.environ.setdefault("RAY_health_check_period_ms", "1000")
    os.environ.setdefault("RAY_health_check_timeout_ms", "2000")
    os.environ.setdefault("RAY_health_check_failure_threshold", "5")
    # After a node loss, Ray Train's elastic policy may first try the old size on stale
    # resource data and wait this long (60 s by default) before settling for fewer workers.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
    # Each node's dashboard agent samples every process's CPU and memory for the dashboard's
    # charts, and records metrics, every 5 s; no test reads either. Once a minute: an idle
    # three-node test cluster takes 3.8 CPU-seconds a minute instead of 5.1, and CI keeps
    # two such clusters up for its whole run.
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
    os.environ.setdefault("METRICS_RECORD_INTERVAL_S", "60")
# No test may reach the EC2 metadata service (169.254.169.254): the AWS SDKs (boto3 and
# pyarrow's C++ one) ask it for credentials and region when none are set.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (tests/support/file_order.py); `make test` keeps this order."""
    files = file_order.order(
        (item.nodeid.split("::", 1)[0] for item in items), file_order.load_seconds()
    )
    rank = {f: i for i, f in enumerate(files)}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


_FILE_TIMES = FileTimes()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _FILE_TIMES.add(report)


@pytest.hookimpl(trylast=True)  # after --durations' list, at the very end
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The ten slowest files (tests/support/slowest_files.py), in every run's summary."""
    if hasattr(config, "workerinput") or not _FILE_TIMES.seconds:
        return  # an xdist worker: the controller prints the whole run's
    terminalreporter.write_sep("=", f"slowest {TOP_FILES} test files (setup + call + teardown)")
    for line in _FILE_TIMES.lines(TOP_FILES):
        terminalreporter.write_line(line)
    if os.environ.get("RAYLIFT_FILE_SECONDS_OUT"):  # what file_order.py orders by
        _FILE_TIMES.write(Path(os.environ["RAYLIFT_FILE_SECONDS_OUT"]))


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this session sees (the parent of the workers'
    own base temps), or the base temp when pytest runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Any) -> Any:
    """build(folder) → JSON-able result, run by the first worker that asks; the others wait
    for it and read the result (a Ray job costs ~45 s of start-up on the CI machine, so the
    workers share what they can)."""
    from filelock import FileLock

    root = _shared_root(tmp_path_factory)
    folder, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(build(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama (random weights from a LlamaConfig), a BPE tokenizer trained here, a
    Ray-template-format dataset and its special-tokens file; built once per session."""
    from tools.tiny import build_all

    def build(folder: Path) -> dict[str, str]:
        return {k: str(v) for k, v in build_all(folder, rows=2000, eval_rows=200).items()}

    return {k: Path(v) for k, v in _once(tmp_path_factory, "tiny", build).items()}


@pytest.fixture
def job(tiny: dict[str, Path], tmp_path: Path):
    """Factory: job(name, **section_overrides) → path of a written job YAML."""

    def make(name: str = "t", **sections: dict[str, Any]) -> Path:
        return write_job(tiny, tmp_path, name, **sections)

    return make


@pytest.fixture(scope="session")
def ddp_reference(ray_cluster, tiny, tmp_path_factory):
    """One straight 12-step DDP run of the base job, shared by every test that compares
    against it (the DDP checks themselves, exact resume, the other strategies' curves):
    each Ray job costs ~45 s of fixed start-up on the CI machine."""
    from tests.support.ray_jobs import run_to_end
    from tools.jobcli import submit
    from trainer.config import load_config

    def build(root: Path) -> dict[str, Any]:
        path = root / "ref.yaml"
        path.write_text(yaml.safe_dump(base_job(tiny, root / "runs", "ref-ddp")))
        _, summary, logs = run_to_end(ray_cluster, path)
        return {"path": str(path), "summary": summary, "logs": logs}

    ref = _once(tmp_path_factory, "ddp-ref", build)
    cfg = submit.absolutize(load_config(Path(ref["path"]), []), Path.cwd())
    run_dir = Path(cfg.storage.path) / "ref-ddp"
    return {"cfg": cfg, "summary": ref["summary"], "logs": ref["logs"], "run_dir": run_dir}


_BUILD_CPU_ADAM = """
import torch
from trainer.strategies.deepspeed.engine import prepare_environment
prepare_environment(torch.device("cpu"))
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load(verbose=False)
"""


PREBUILD_ENV = "RAYLIFT_TEST_PREBUILD_CPU_ADAM"
"""1 (make test sets it): the session starts building DeepSpeed's CPU Adam at once, in the
background at nice 19, under the same lock as `ds_cpu_adam`; the fixture then finds it
built instead of compiling it on its test's worker (~140 CPU-seconds)."""
_PREBUILD = (
    "import os\n"
    "os.nice(19)\n"
    "from pathlib import Path\n"
    "from filelock import FileLock\n"
    "from trainer.strategies.deepspeed.engine import EXTENSIONS_DIR\n"
    "root = Path(os.environ.get('TORCH_EXTENSIONS_DIR', EXTENSIONS_DIR))\n"
    "root.mkdir(parents=True, exist_ok=True)\n"
    "with FileLock(str(root / 'cpu_adam.build.lock')):\n"
    "    exec(compile(os.environ['RAYLIFT_BUILD_CPU_ADAM'], 'cpu_adam', 'exec'))\n"
)
_prebuild: subprocess.Popen[bytes] | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Most of an integration test's time is single-threaded start-up and polls, so the
    build fills idle CPU while the first files run, off any test's clock. Started once, by
    the controller (an xdist worker starts none); the fixture below waits on its lock."""
    global _prebuild
    if os.environ.get(PREBUILD_ENV) != "1" or hasattr(session.config, "workerinput"):
        return
    _prebuild = subprocess.Popen(
        [sys.executable, "-c", _PREBUILD],
        cwd=ROOT,
        env={**os.environ, "RAYLIFT_BUILD_CPU_ADAM": _BUILD_CPU_ADAM},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A build still running when the session ends (a short `make test PYTEST_ARGS=-k…`)
    is waited for, never killed: torch's JIT build holds a lock file in the cache while it
    compiles, and a build killed there leaves every later load waiting on it."""
    if _prebuild is not None:
        _prebuild.wait()


@pytest.fixture(scope="session")
def ds_cpu_adam() -> Path:
    """DeepSpeed's C++ CPU Adam, JIT-built once per CI run into the torch-extensions cache
    that every process on this machine shares (trainer.strategies.deepspeed.engine: under
    TMPDIR, which `make test` starts fresh), so Ray workers load it instead of each
    compiling it. It is what a user's offloaded ZeRO run gets; ~140 CPU-seconds to build
    here. A file lock keeps two pytest-xdist workers (and make test's background build,
    PREBUILD_ENV) from building it side by side: after one, the next only loads it."""
    from filelock import FileLock

    from trainer.strategies.deepspeed.engine import EXTENSIONS_DIR

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR))
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "cpu_adam.build.lock")):
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_CPU_ADAM],
            cwd=ROOT,
            capture_output=True,
            text=True,
            # ~140 CPU-seconds, but on a 2-core machine shared by several test runs the
            # compiler has been seen to get 2% of a core for 20 minutes.
            timeout=3600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture(scope="session")
def ray_cluster():
    """Three Ray nodes on 127.0.0.1: a head with no CPUs (only the job driver and the
    Train controller run there), a worker node labelled large_cpu_mem=true, and a plain
    worker node — so a 2-worker run spans two nodes and rank 0 has a labelled home."""
    from tests.support.cluster_start import start_with_retries
    from tools.localcluster import LocalCluster

    def make(built: list[Any]) -> LocalCluster:
        cluster = LocalCluster(num_cpus=0)
        built.append(cluster)
        cluster.start()
        cluster.add_node(num_cpus=1, labels={"large_cpu_mem": "true"})
        cluster.add_node(num_cpus=1, labels={"pool": "cpu"})
        cluster.wait_nodes(3)
        return cluster

    # a loaded machine's raylet can miss Ray's fixed 30 s to register: a fresh cluster
    cluster = start_with_retries(make, lambda c: c.stop())
    try:
        os.environ["RAY_AUTH_TOKEN"] = cluster.token  # what tools/submit.py reads
        yield cluster
    finally:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A SeaweedFS S3 server on 127.0.0.1 with a bucket `ckpt`; credentials are set in
    the environment for pyarrow, boto3 and Ray."""
    server = WeedServer(tmp_path_factory.mktemp("weed"))
    server.start()
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = S3_KEY, S3_SECRET
    try:
        yield {
            "endpoint": server.endpoint,
            "client": server.client,
            "bucket": "ckpt",
            "server": server,
        }
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
