"""tests/support/cluster_start.py: a cluster start that misses Ray's fixed 30 s is stopped
whole and made again; any other error, or the last miss, is raised at once."""

from __future__ import annotations

import pytest

from tests.support.cluster_start import start_with_retries

MISS = Exception("The current node timed out during startup. This could happen ...")


def _maker(errors: list[Exception | None]):
    made, stopped = [], []

    def make(built: list) -> str:
        name = f"cluster{len(made)}"
        made.append(name)
        built.append(name)
        err = errors[len(made) - 1]
        if err is not None:
            raise err
        return name

    return make, made, stopped


def test_a_missed_start_is_stopped_and_made_again() -> None:
    make, made, stopped = _maker([MISS, None])
    assert start_with_retries(make, stopped.append) == "cluster1"
    assert made == ["cluster0", "cluster1"] and stopped == ["cluster0"]


def test_another_error_or_the_last_miss_is_raised() -> None:
    make, made, stopped = _maker([ValueError("bad port"), None])
    with pytest.raises(ValueError, match="bad port"):
        start_with_retries(make, stopped.append)
    assert made == ["cluster0"] and stopped == ["cluster0"]
    make, made, stopped = _maker([MISS, MISS, MISS])
    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retries(make, stopped.append, attempts=3)
    assert stopped == made == ["cluster0", "cluster1", "cluster2"]
