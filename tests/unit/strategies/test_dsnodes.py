"""NVMe offload's needs on a node (trainer.strategies.deepspeed.nodes): its folder, and
DeepSpeed's async I/O op, probed with DeepSpeed's own compatibility check."""

from __future__ import annotations

import pytest

from trainer.errors import ConfigError
from trainer.strategies.deepspeed import nodes as dsnodes

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_a_missing_folder_is_named_with_its_key_and_the_fix(tmp_path):
    missing = tmp_path / "zero"
    problem = dsnodes.local_problem({KEY: str(missing)})
    assert problem == (
        f"{KEY} {missing} does not exist; create it on every worker node (a local NVMe "
        "mount), or set the offload device to cpu"
    )
    with pytest.raises(ConfigError, match=rf"^ds\.json: on node \S+: {KEY} {missing} does not"):
        dsnodes.check_here({KEY: str(missing)}, "ds.json")


def test_a_folder_that_cannot_be_written_is_refused():
    # /proc refuses new files even to root (chmod would not stop root).
    assert "/proc is not writable" in dsnodes.local_problem({KEY: "/proc"})


def test_an_existing_folder_passes_exactly_when_deepspeeds_async_io_op_can_run(tmp_path):
    """DeepSpeed's probe needs libaio (this machine lacks it, so the folder passes and the
    op is what is refused); the trainer images carry it with the op prebuilt
    (tests/integration/test_images.py)."""
    problem = dsnodes.local_problem({KEY: str(tmp_path)})
    if dsnodes.async_io_available():
        assert problem is None
    else:
        assert problem is not None and problem.startswith("DeepSpeed's async_io op cannot run")


class _Builder:
    name = "async_io"

    def __init__(self, loads: bool, compatible: bool) -> None:
        self.loads, self.compatible, self.loaded = loads, compatible, False

    def load(self, verbose: bool = False):
        if not self.loads:
            raise ImportError("libaio.so.1: cannot open shared object file")
        self.loaded = True

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.compatible


@pytest.mark.parametrize(
    ("prebuilt", "loads", "compatible", "available"),
    [
        (True, True, False, True),  # the trainer images: prebuilt, no compiler for the probe
        (True, False, True, False),  # prebuilt, but libaio's library is missing
        (False, False, True, True),  # JIT: DeepSpeed's probe compiles against libaio
        (False, False, False, False),
    ],
)
def test_a_prebuilt_async_io_op_counts_when_it_loads(monkeypatch, prebuilt, loads, compatible,
                                                      available):  # fmt: skip
    import deepspeed.git_version_info as info
    import deepspeed.ops.op_builder as op_builder

    builder = _Builder(loads, compatible)
    monkeypatch.setattr(op_builder, "AsyncIOBuilder", lambda: builder)
    monkeypatch.setitem(info.installed_ops, "async_io", prebuilt)
    assert dsnodes.async_io_available() is available
    assert builder.loaded is (prebuilt and loads)


def test_a_folder_under_the_nodes_local_nvme_is_made_and_elsewhere_it_is_not(tmp_path, monkeypatch):
    """A Raylift node's instance store is mounted empty at RAYLIFT_LOCAL_STORAGE: the
    template's nvme_path under it is made, so the file runs unchanged; a path elsewhere
    is still refused."""
    from trainer.storage import local

    mount = tmp_path / "local_storage"
    mount.mkdir()
    monkeypatch.setenv(local.ENV, str(mount))
    monkeypatch.setattr(dsnodes, "async_io_available", lambda: True)
    assert dsnodes.local_problem({KEY: str(mount / "zero")}) is None
    assert (mount / "zero").is_dir()
    elsewhere = tmp_path / "elsewhere" / "zero"
    assert "does not exist" in dsnodes.local_problem({KEY: str(elsewhere)})
    assert not elsewhere.exists()
    # Without the mount (a laptop, CI, a node with no instance store) nothing is made.
    monkeypatch.delenv(local.ENV)
    assert "does not exist" in dsnodes.local_problem({KEY: str(mount / "other")})
    assert not (mount / "other").exists()
