"""Ray's real autoscaler v2 with our node provider, against moto's AWS server on 127.0.0.1.

The cluster starts with its head alone (every worker pool's group at zero). A Ray Train job
asks for two GPU-shaped workers, rank 0 on `large_cpu_mem`; the autoscaler launches the
`large-cpu-mem` pool and, spot first, the `gpu-spot` pool, whose instance never runs Ray
(the boot simulator leaves it down: a launch that never delivers a node), so after the
launch timeout v2 ends it and launches `gpu-ondemand` instead. The job runs on what came up,
no node holding a worker is ended while it runs, and after the idle timeout every pool is
back at zero. One scenario runs once (module fixture); each test asserts one promise of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from infra.autoscaler import autoscaler_config
from infra.settings import parse_settings
from tests.support.autoscaling_cluster import (
    BootSimulator,
    _free_port,
    _kill_tree,
    local_root,
    node_env,
    start_ray,
)
from tests.support.aws import HOST, REGION, group, live_instances, make_pools, moto_server

pytestmark = pytest.mark.slow

IDLE_MINUTES = 0.25  # 15 s
LAUNCH_TIMEOUT_S = 45  # a local node boots in seconds, even on a loaded machine
JOB_SECONDS = 25  # longer than the idle timeout: a busy node ended would be caught
WORKER_POOLS = ("large-cpu-mem", "gpu-spot", "gpu-ondemand")


def _local_config(endpoint: str, cluster: str) -> dict:
    """infra's own head config for these pools, made to fit one machine: each node offers
    one CPU and its GPUs as a custom `gpu_slot` resource (no GPU here), and the provider
    talks to moto."""
    settings = parse_settings(
        {
            "clusterName": cluster,
            "image": {"tag": "trainer-gpu-0.1.0-abcdef0"},
            "autoscaling": {"idleMinutes": IDLE_MINUTES},
            "pools": {
                "largeCpuMem": {"instanceTypes": ["g5.8xlarge"], "maxNodes": 1},
                "gpuSpot": {"maxNodes": 1},
                "gpuOnDemand": {"maxNodes": 1},
                "cpu": {"maxNodes": 0},
            },
        }
    )
    config = autoscaler_config(settings, REGION)
    for name, node_type in config["available_node_types"].items():
        if name == "head":
            continue
        res = node_type["resources"]
        node_type["resources"] = {
            "CPU": 1,
            "gpu_slot": res.pop("GPU"),
            **{k: v for k, v in res.items() if k not in ("CPU", "memory")},
        }
    config["provider"]["endpoint_url"] = endpoint
    return config


@pytest.fixture(scope="module")
def scenario():
    root = local_root()
    cluster = "autoscale"
    with moto_server() as endpoint:
        groups = make_pools(
            endpoint,
            cluster,
            {
                "head": {"min": 1, "max": 1, "desired": 1, "role": "head", "types": ["m5.xlarge"]},
                "large-cpu-mem": {"max": 1, "types": ["g5.8xlarge"]},
                "gpu-spot": {"max": 1, "market": "spot", "types": ["g5.4xlarge", "g5.2xlarge"]},
                "gpu-ondemand": {"max": 1, "types": ["g5.4xlarge"]},
            },
        )
        config = _local_config(endpoint, cluster)
        config_file = root / "autoscaler.yaml"
        config_file.write_text(yaml.safe_dump(config))
        port = _free_port()
        gcs = f"{HOST}:{port}"
        [head_instance] = live_instances(endpoint, groups["head"])
        (root / "head").mkdir()
        head = start_ray(
            [
                "--head",
                f"--port={port}",
                f"--node-ip-address={HOST}",
                "--num-cpus=0",
                f"--autoscaling-config={config_file}",
                "--include-dashboard=false",
                "--dashboard-agent-listen-port=0",
                f"--ray-client-server-port={_free_port()}",
                "--object-store-memory=80000000",
                f"--temp-dir={root / 'head'}",
            ],
            node_env(
                {
                    "RAY_enable_autoscaler_v2": "1",
                    "RAY_CLOUD_INSTANCE_ID": head_instance,
                    "RAY_NODE_TYPE_NAME": "head",
                    "RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S": str(LAUNCH_TIMEOUT_S),
                    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                }
            ),
            root / "head.log",
        )
        boots = BootSimulator(
            endpoint=endpoint,
            groups={p: groups[p] for p in WORKER_POOLS},
            gcs=gcs,
            shapes=config["available_node_types"],
            root=root,
            never_boot={"gpu-spot"},
        )
        try:
            at_start = {p: live_instances(endpoint, groups[p]) for p in WORKER_POOLS}
            boots.start()
            out = root / "job.json"
            submitted = time.time()
            job = _run_job(
                [
                    sys.executable,
                    "-m",
                    "tests.support.autoscaling_job",
                    gcs,
                    str(config_file),
                    "2",
                    str(JOB_SECONDS),
                    str(out),
                ],
                env=node_env(
                    {
                        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "240",
                        # The driver keeps 127.0.0.1 (Ray would swap in the outward address).
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    }
                ),
                cwd=Path(__file__).resolve().parents[2],
            )
            finished = time.time()
            # Back to zero: wait for the groups to empty (the idle timeout, then the drain).
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and any(
                live_instances(endpoint, groups[p]) or group(endpoint, groups[p])["DesiredCapacity"]
                for p in WORKER_POOLS
            ):
                time.sleep(0.5)
            at_zero = time.time()
            result = {
                "job": job,
                "job_out": json.loads(out.read_text()) if out.exists() else None,
                "at_start": at_start,
                "at_end": {p: live_instances(endpoint, groups[p]) for p in WORKER_POOLS},
                "desired_at_end": {
                    p: group(endpoint, groups[p])["DesiredCapacity"] for p in WORKER_POOLS
                },
                "submitted": submitted,
                "finished": finished,
                "at_zero": at_zero,
                "events": list(boots.events),
                "boot_errors": list(boots.errors),
                "monitor_log": "".join(
                    p.read_text(errors="replace")[-6000:]
                    for p in (root / "head").glob("session_latest/logs/monitor*.log")
                ),
            }
            times = _timings(result)
            print("autoscaling timings:", json.dumps(times))
            build = Path(__file__).resolve().parents[2] / "build"
            build.mkdir(exist_ok=True)
            (build / "autoscaling-timings.json").write_text(json.dumps(times, indent=2))
            yield result
        finally:
            boots.stop()
            _kill_tree(head, str(root / "head"))
            shutil.rmtree(root, ignore_errors=True)


def _run_job(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """The driver, bounded: a job that never gets its workers fails the tests that need it
    (with its output), and the cluster is still checked for going back to zero."""
    proc = subprocess.Popen(
        args,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += "\n(the job did not finish in 300 s)"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _first(events, kind, pool):
    return min((e.t for e in events if e.kind == kind and e.pool == pool), default=None)


def _timings(r) -> dict:
    ev, t0 = r["events"], r["submitted"]
    rel = lambda t: None if t is None else round(t - t0, 1)  # noqa: E731
    return {
        "first_launch_s": rel(min((e.t for e in ev if e.kind == "launched"), default=None)),
        "spot_given_up_s": rel(_first(ev, "ended", "gpu-spot")),
        "ondemand_launched_s": rel(_first(ev, "launched", "gpu-ondemand")),
        "job_done_s": rel(r["finished"]),
        "fit_s": r["job_out"] and round(r["job_out"]["fit_s"], 1),
        "zero_after_job_s": round(r["at_zero"] - r["finished"], 1),
        "idle_timeout_s": IDLE_MINUTES * 60,
        "launch_timeout_s": LAUNCH_TIMEOUT_S,
    }


def _explain(r) -> str:
    return (
        f"job rc={r['job'].returncode}\n{r['job'].stdout[-3000:]}\n{r['job'].stderr[-5000:]}\n"
        f"events={[asdict(e) for e in r['events']]}\nboot errors={r['boot_errors']}\n"
        f"monitor:\n{r['monitor_log'][-5000:]}"
    )


def test_pools_start_at_zero(scenario) -> None:
    assert scenario["at_start"] == {p: [] for p in WORKER_POOLS}


def test_the_job_runs_on_launched_nodes_rank0_on_large_cpu_mem(scenario) -> None:
    assert scenario["job"].returncode == 0, _explain(scenario)
    out = scenario["job_out"]
    assert out["selector"] == [{"large_cpu_mem": "true"}, {}]  # requested while none was up
    rows = {w["rank"]: w for w in out["workers"]}
    assert rows[0]["pool"] == "large-cpu-mem"
    assert rows[1]["pool"] == "gpu-ondemand"
    launched = {e.instance for e in scenario["events"] if e.kind == "launched"}
    assert {rows[0]["instance"], rows[1]["instance"]} <= launched
    assert all(w["all_reduces"] > 0 for w in out["workers"])


def test_spot_first_then_on_demand_when_spot_never_comes_up(scenario) -> None:
    ev = scenario["events"]
    spot_launch = _first(ev, "launched", "gpu-spot")
    spot_end = _first(ev, "ended", "gpu-spot")
    ondemand = _first(ev, "launched", "gpu-ondemand")
    assert spot_launch is not None and ondemand is not None, _explain(scenario)
    assert ondemand - spot_launch >= LAUNCH_TIMEOUT_S - 1, "on demand only once spot failed"
    assert spot_end is not None and spot_end < scenario["finished"], "spot's launch given back"
    assert spot_end - spot_launch >= LAUNCH_TIMEOUT_S - 1, "given up after the launch timeout"
    assert not [e for e in ev if e.kind == "booted" and e.pool == "gpu-spot"]


def test_no_node_running_a_worker_is_ended_while_the_job_runs(scenario) -> None:
    assert scenario["job"].returncode == 0, _explain(scenario)
    workers = {w["instance"] for w in scenario["job_out"]["workers"]}
    ended = {e.instance: e.t for e in scenario["events"] if e.kind == "ended"}
    assert workers <= set(ended), "and they are ended once idle"
    assert all(ended[i] > scenario["finished"] - 1 for i in workers)


def test_back_to_zero_after_the_idle_timeout(scenario) -> None:
    assert scenario["at_end"] == {p: [] for p in WORKER_POOLS}, _explain(scenario)
    assert scenario["desired_at_end"] == dict.fromkeys(WORKER_POOLS, 0)
    assert scenario["at_zero"] - scenario["finished"] >= IDLE_MINUTES * 60 - 1
