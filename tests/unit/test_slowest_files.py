"""The slowest-files summary every `make test` prints (tests/support/slowest_files.py):
each file's setup, call and teardown summed, files ranked by that sum, ten at most."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.slowest_files import FileTimes


def _report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def test_files_rank_by_their_summed_phases_and_only_the_top_are_listed():
    times = FileTimes()
    for i in range(12):
        times.add(_report(f"tests/f{i:02d}.py::t", "call", float(i)))
    # A file whose fixture set-up dominates ranks by its whole cost, not its calls.
    times.add(_report("tests/big.py::a", "setup", 40.0))
    times.add(_report("tests/big.py::a", "call", 1.0))
    times.add(_report("tests/big.py::b", "call", 2.0))
    times.add(_report("tests/big.py::b", "teardown", 3.0))
    lines = times.lines(top=10)
    assert len(lines) == 11  # ten files and the total
    assert lines[0].split() == ["46.0", "s", "2", "tests", "tests/big.py"]
    assert lines[1].endswith("tests/f11.py") and lines[9].endswith("tests/f03.py")
    assert lines[-1].split()[:2] == [f"{46.0 + sum(range(12)):.1f}", "s"]
