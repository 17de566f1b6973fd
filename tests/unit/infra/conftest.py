"""Session fixtures for the infra tests (helpers live in infra_stack.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Make the helpers importable whatever pytest's import mode, and the repo root for `infra`.
_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parents[2]):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from infra_stack import FULL_CONFIG, INFRA, Stack, StackRunner, stack_file_config  # noqa: E402


@pytest.fixture(scope="session")
def run_stack(tmp_path_factory: pytest.TempPathFactory) -> StackRunner:
    return StackRunner(tmp_path_factory.mktemp("infra-stacks"))


@pytest.fixture(scope="session")
def full_stack(run_stack: StackRunner) -> Stack:
    return run_stack(FULL_CONFIG)


@pytest.fixture(scope="session")
def example_stack(run_stack: StackRunner) -> Stack:
    return run_stack(stack_file_config(INFRA / "Pulumi.example.yaml"))
