"""The test tree's own rule: no two test files share a basename. The test folders are not
packages, so pytest imports each file under its basename, and a second file of the same
name fails collection ("import file mismatch") only when both land on one xdist worker."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
