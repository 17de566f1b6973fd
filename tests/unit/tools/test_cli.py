"""`raylift`, the one installed command (tools/cli.py): every verb listed, each verb the same
as its script in tools/, an unknown verb one line and exit 2; and the scripts in tools/ run
from any folder without putting the checkout on sys.path themselves (the editable install
of the `tools` package does that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import llama7b_job

ROOT = Path(__file__).resolve().parents[3]
RAYLIFT = Path(sys.executable).with_name("raylift")
VERBS = (
    "run",
    "status",
    "logs",
    "stop",
    "list",
    "doctor",
    "plan",
    "image",
    "report",
    "demo",
    "gpu-check",
)
ENTRIES = (
    "demo/__main__",
    "gpucheck/__main__",
    "image",
    "localcluster",
    "plan/__main__",
    "report/__main__",
    "submit",
)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH: what finds `tools` and `trainer` must be the install, not the caller.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def raylift() -> str:
    assert RAYLIFT.is_file(), f"{RAYLIFT} is missing: pip install -e . installs it"
    return str(RAYLIFT)


def test_help_lists_every_verb_with_one_line(raylift, tmp_path):
    out = _run([raylift, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for verb in VERBS:
        line = next((x for x in lines if x.split()[:1] == [verb]), None)
        assert line is not None and len(line.split()) > 1, f"{verb} not listed:\n{out.stdout}"


def test_plan_verb_is_tools_plan_py(raylift, tmp_path):
    job = str(llama7b_job(tmp_path))  # the planner tests' Llama-2-7B job
    args = [job, "--instance", "g5.xlarge", "--json"]
    verb = _run([raylift, "plan", *args], tmp_path)
    script = _run([sys.executable, str(ROOT / "tools" / "plan" / "__main__.py"), *args], tmp_path)
    assert verb.returncode == script.returncode == 2, verb.stderr + script.stderr  # won't fit
    assert json.loads(verb.stdout) == json.loads(script.stdout)
    assert json.loads(verb.stdout)["params"] == 6_738_415_616


def test_job_verbs_reach_the_job_cli_with_their_verb(raylift, tmp_path):
    out = _run([raylift, "run", str(tmp_path / "missing.yaml")], tmp_path)
    assert out.returncode == 2
    assert "missing.yaml: config file not found" in out.stderr
    usage = _run([raylift, "status", "--help"], tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: raylift status")


def test_the_image_verb_names_itself_in_its_usage(raylift, tmp_path):
    usage = _run([raylift, "image", "--help"], tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: raylift image"), usage
    script = _run([sys.executable, str(ROOT / "tools" / "image.py"), "--help"], tmp_path)
    assert script.stdout.startswith("usage: tools/image.py"), script


def test_an_unknown_verb_is_one_line_and_exit_2(raylift, tmp_path):
    out = _run([raylift, "nosuchverb"], tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "nosuchverb" in out.stderr


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_script_runs_from_another_folder(entry, tmp_path):
    out = _run([sys.executable, str(ROOT / "tools" / f"{entry}.py"), "--help"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:"), out.stdout[:500]
    if entry == "submit":
        assert all(verb in out.stdout for verb in VERBS[:6])


def test_no_tool_puts_the_checkout_on_sys_path():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "tools").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "sys.path.insert" in line or "sys.path.append" in line
    ]
    assert offenders == [], "tools is an installed package; no sys.path edits: " + ", ".join(
        offenders
    )
