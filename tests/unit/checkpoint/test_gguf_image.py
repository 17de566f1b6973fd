"""The trainer images carry the gguf package that export.formats gguf writes with, at the
pin the project tests (pyproject's train extra): every trainer lock (GPU/CPU and ccl) and
both inputs, so a run that asks for GGUF does not fail at its first export on a node."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _pin(lines: list[str], name: str) -> str | None:
    for line in lines:
        m = re.fullmatch(rf"{name}==([^\s#;]+)", line.split("#")[0].strip())
        if m:
            return m.group(1)
    return None


def test_trainer_images_lock_the_tested_gguf() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [p for deps in project["optional-dependencies"].values() for p in deps]
    want = _pin(pins, "gguf")
    assert want == "0.19.0"
    for name in (
        "requirements.in",
        "requirements-ccl.in",
        "requirements.lock",
        "requirements-ccl.lock",
    ):
        lines = (ROOT / "images" / "trainer" / name).read_text().splitlines()
        assert _pin(lines, "gguf") == want, name
