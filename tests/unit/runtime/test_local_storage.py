"""The node's instance-store NVMe as the trainer sees it (RAYLIFT_LOCAL_STORAGE, set by the
node's start script where the boot mounted it): scratch goes there, else to TMPDIR; the
doctor reports its size, and fails a node whose instance type has one that is not mounted."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.runtime import doctor
from trainer.storage import local


def test_scratch_goes_to_the_local_nvme_where_it_is_mounted(tmp_path, monkeypatch):
    nvme = tmp_path / "local_storage"
    nvme.mkdir()
    monkeypatch.setenv(local.ENV, str(nvme))
    folder = local.scratch_dir("raylift-ckpt-7-r0-")
    assert folder.parent == nvme / "raylift" and folder.name.startswith("raylift-ckpt-7-r0-")
    assert folder.is_dir()


def test_without_it_scratch_stays_in_tmpdir(tmp_path, monkeypatch):
    monkeypatch.delenv(local.ENV, raising=False)
    assert local.local_storage() is None
    assert local.scratch_dir("x-").parent == Path(tempfile.gettempdir())
    # Named but absent (a reboot without the mount): never a folder on the root disk.
    monkeypatch.setenv(local.ENV, str(tmp_path / "not-mounted"))
    assert local.local_storage() is None
    assert local.scratch_dir("x-").parent == Path(tempfile.gettempdir())
    assert not (tmp_path / "not-mounted").exists()


def test_the_doctor_reports_the_local_nvme_and_its_size(tmp_path, monkeypatch):
    monkeypatch.setenv(local.ENV, str(tmp_path))
    monkeypatch.setenv("RAYLIFT_INSTANCE_TYPE", "g5.12xlarge")
    row = doctor._local_storage()
    assert row["ok"] and f"{tmp_path} on " in row["value"] and row["value"].endswith(" GB")
    assert "writable" in row["value"]


def test_the_doctor_fails_a_node_whose_instance_store_is_not_mounted(monkeypatch):
    monkeypatch.delenv(local.ENV, raising=False)
    monkeypatch.setenv("RAYLIFT_INSTANCE_TYPE", "g5.xlarge")
    row = doctor._local_storage()
    assert not row["ok"] and "a g5.xlarge has 250 GB of instance-store NVMe" in row["value"]
    # A node type without instance store (or a local cluster) is fine without it.
    monkeypatch.setenv("RAYLIFT_INSTANCE_TYPE", "m5.xlarge")
    assert doctor._local_storage()["ok"]
    monkeypatch.delenv("RAYLIFT_INSTANCE_TYPE")
    assert doctor._local_storage() == {
        "value": "none on this node (scratch goes to the temp folder)",
        "ok": True,
    }
