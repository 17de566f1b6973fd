"""Fixtures for the images/ and tools/image.py tests.

tools/ is not a package (each tool runs as `python tools/X.py`), so the module is loaded
from its file once per session and registered in sys.modules (dataclasses need that).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL_PATH = REPO_ROOT / "tools" / "image.py"

# Notes from the lock checks (what PyPI could not answer), printed at the end of the run.
LOCK_NOTES: list[str] = []


def _load_tool() -> ModuleType:
    name = "raylift_tools_image"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOL_PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tool() -> ModuleType:
    return _load_tool()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def graph(tool: ModuleType):
    return tool.load_graph(tool.DEFAULT_GRAPH, REPO_ROOT)


@pytest.fixture(scope="session")
def lock_notes() -> list[str]:
    """Where lock tests put what they could not check; printed in the terminal summary."""
    return LOCK_NOTES


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say what the lock check could not verify against PyPI, even when everything passed."""
    if LOCK_NOTES:
        terminalreporter.section("image locks: checked differently or not at all")
        for note in sorted(set(LOCK_NOTES)):
            terminalreporter.write_line(note)
