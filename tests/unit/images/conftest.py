"""Fixtures for the images/ and image tool tests.

`tool` is the tools.imagetool package: its names are the tool's API (re-exported from its
single-concern modules), so tests need not know which module holds what.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

import tools.imagetool

REPO_ROOT = Path(__file__).resolve().parents[3]

# Notes from the lock checks (what PyPI could not answer), printed at the end of the run.
LOCK_NOTES: list[str] = []


@pytest.fixture(scope="session")
def tool() -> ModuleType:
    return tools.imagetool


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
