"""tests/support/file_order.py: `make test` hands out the longest files first, guesses for
files it has no figure for, keeps test_autoscaling ahead of the RAM tier's tests, and its
figures name files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import file_order
from tests.support.jobs import ROOT

SECONDS = {
    "tests/unit/test_a.py": 3.0,
    "tests/integration/test_long.py": 300.0,
    "tests/integration/test_memory_tier.py": 500.0,
    "tests/integration/test_autoscaling.py": 150.0,
}


def test_longest_first_with_guesses_for_files_without_a_figure() -> None:
    files = [
        "tests/unit/test_a.py",
        "tests/unit/test_new.py",  # no figure: 2 s
        "tests/bench/test_bench_new.py",  # no figure: 10 s
        "tests/integration/test_long.py",
        "tests/integration/test_new.py",  # no figure: 60 s
    ]
    assert file_order.order(files, SECONDS) == [
        "tests/integration/test_long.py",
        "tests/integration/test_new.py",
        "tests/bench/test_bench_new.py",
        "tests/unit/test_a.py",
        "tests/unit/test_new.py",
    ]


def test_the_ram_tier_follows_autoscaling_whatever_their_figures() -> None:
    files = list(SECONDS)
    ranked = file_order.order(files, SECONDS)
    assert ranked == [
        "tests/integration/test_long.py",
        "tests/integration/test_autoscaling.py",
        "tests/integration/test_memory_tier.py",
        "tests/unit/test_a.py",
    ]
    # and nothing moves where the order is right already
    quick = {**SECONDS, "tests/integration/test_memory_tier.py": 100.0}
    assert file_order.order(files, quick)[1:3] == [
        "tests/integration/test_autoscaling.py",
        "tests/integration/test_memory_tier.py",
    ]


def test_the_recorded_figures_name_test_files_that_exist() -> None:
    seconds = file_order.load_seconds()
    assert seconds, "file_seconds.json is empty"
    for rel, s in seconds.items():
        assert re.fullmatch(r"tests/(unit|integration|bench)/.*test_[\w]+\.py", rel), rel
        assert (ROOT / rel).is_file(), f"{rel}: gone; write file_seconds.json again"
        assert s >= 0
    assert Path(file_order.SECONDS_FILE).parent == ROOT / "tests" / "support"
