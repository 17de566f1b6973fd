"""Where a RAM-tier snapshot is staged (trainer.checkpoint.memory.snapshot_dir): in the
node's memory (tmpfs) when it has room, never touching the disk; on the scratch disk when
the tmpfs is short of room or the bench asks for the old way."""

from __future__ import annotations

import shutil

from trainer.checkpoint import memory


def test_in_memory_when_there_is_room_else_the_disk(monkeypatch) -> None:
    monkeypatch.delenv(memory.STAGING_ENV, raising=False)
    free = shutil.disk_usage(memory.SHM).free
    out = memory.snapshot_dir(last_bytes=1024)
    try:
        assert out.parent == memory.SHM and out.is_dir()
    finally:
        shutil.rmtree(out)
    big = memory.snapshot_dir(last_bytes=free)  # three times this does not fit
    try:
        assert memory.SHM not in big.parents
    finally:
        shutil.rmtree(big)
    monkeypatch.setenv(memory.STAGING_ENV, "disk")
    disk = memory.snapshot_dir(last_bytes=0)
    try:
        assert memory.SHM not in disk.parents
    finally:
        shutil.rmtree(disk)
