"""The local cluster's folder: under TMPDIR when Ray's socket paths fit, else /tmp."""

from __future__ import annotations

import tempfile

from tools import localcluster


def _root_for(tmpdir: str, monkeypatch) -> str:
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)
    return localcluster._short_temp_root()


def test_short_tmpdir_is_used(monkeypatch):
    assert _root_for("/tmp/rlci.abc123", monkeypatch) == "/tmp/rlci.abc123"


def test_deep_tmpdir_falls_back_so_sockets_fit(monkeypatch):
    deep = "/tmp/tmp.MC8BoWg7K4/raylift-ci.Ye1OSH"  # broke Ray's plasma socket path once
    assert _root_for(deep, monkeypatch) == "/tmp"
    longest = "/tmp/rl-velap114/ray/session_2026-11-22_18-41-04_398256_7636/sockets/plasma_store"
    assert len(longest) <= localcluster.SOCKET_PATH_MAX


def test_a_process_that_starts_a_cluster_stays_on_loopback():
    """Ray reads its loopback-only setting when first imported: LocalCluster sets it before
    importing Ray, so a driver in the same process (the data benchmark's) connects to
    127.0.0.1, not to the machine's outward address (where it hung). Checked on the
    setting Ray's address resolution reads, so a failure sends no traffic anywhere."""
    import subprocess
    import sys

    probe = (
        "from tools.localcluster import LocalCluster\n"
        "with LocalCluster(num_cpus=0) as c:\n"
        "    from ray._private import ray_constants\n"
        "    print(ray_constants.ENABLE_RAY_CLUSTER, c.address.split(':')[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert out.stdout.split() == ["False", "127.0.0.1"], out.stderr[-2000:]


def test_the_job_agent_serves_though_a_port_picked_for_it_is_taken_before_it_binds():
    """The head's dashboard agent binds a free port itself. A port picked for it in
    advance can be taken before the agent starts (the agent then serves no HTTP, never
    registers, and no job can be submitted: a fresh-clone CI saw this once). Here every
    port LocalCluster would pick in advance is already taken by a listening socket; the
    cluster still becomes ready (its job agent registered and answering) elsewhere."""
    import subprocess
    import sys

    probe = (
        "import socket\n"
        "from tools import localcluster\n"
        "held = socket.socket()\n"
        "held.bind(('127.0.0.1', 0))\n"
        "held.listen()\n"
        "taken = held.getsockname()[1]\n"
        "dashboard = localcluster.free_port()  # not `taken`: that one is held\n"
        "localcluster.free_port = lambda: taken\n"
        "c = localcluster.LocalCluster(num_cpus=0, dashboard_port=dashboard)\n"
        "c.start(timeout=60)\n"
        "try:\n"
        "    print(taken, c._job_agent_url().rsplit(':', 1)[1])\n"
        "finally:\n"
        "    c.stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    taken, agent_port = out.stdout.split()
    assert agent_port != taken
