"""`submit.py doctor` on a three-node local cluster where one worker node has a wrong S3
secret (its own raylet environment): the bucket row of exactly that node is red, every
other row of every node is green (versions, memory, shared folder, auth, the gloo
all-reduce across all three nodes), and the exit code is non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import submit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _tables(text: str) -> dict[str, dict[str, str]]:
    """Rendered tables → {title: {check: "ok"|"FAIL"}} (first line of each row)."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(("node ", "cluster")):
            current = tables.setdefault(line.strip(), {})
        elif current is not None and line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if cells[0] and cells[-1] in ("ok", "FAIL"):
                current[cells[0]] = cells[-1]
    return tables


def test_doctor_finds_the_node_that_cannot_write_the_bucket(
    s3_server, tmp_path, monkeypatch, capsys
):
    nodes = [
        {"labels": {"pool": "good"}},
        {"labels": {"pool": "broken"}, "env": {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}},
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.cluster_proc", json.dumps(nodes)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the cluster is ready (or its process died)
        assert line, "the cluster process ended before its cluster was ready"
        info = json.loads(line)
        monkeypatch.setenv("RAY_AUTH_TOKEN", info["token"])
        argv = ["doctor", "--address", info["url"], "--shared", str(tmp_path)]
        argv += ["--storage", "s3://ckpt/doctor"]
        argv += ["--endpoint-override", s3_server["endpoint"]]
        rc = submit.main(argv)
        out = capsys.readouterr()
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    tables = _tables(out.out)
    assert len(tables) == 4, out.out  # three nodes and the cluster table
    failed = [(t, c) for t, rows in tables.items() for c, v in rows.items() if v == "FAIL"]
    assert len(failed) == 1 and "pool=broken" in failed[0][0] and failed[0][1] == "bucket", out.out
    for rows in tables.values():
        if "torch" in rows:
            checks = {"python", "ray", "torch", "transformers", "shared folder", "bucket"}
            assert checks <= set(rows), rows
    assert tables["cluster"] == {"collective": "ok", "jobs api auth": "ok"}
    assert "gloo all-reduce over 3 nodes: sum 6 (want 6)" in out.out
    assert rc == 1 and "doctor: 1 check(s) failed" in out.err
