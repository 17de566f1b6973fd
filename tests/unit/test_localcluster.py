"""The local cluster's folder: under TMPDIR when Ray's socket paths fit, else /tmp."""

from __future__ import annotations

import tempfile

from tools import localcluster


def _root_for(tmpdir: str, monkeypatch) -> str:
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)
    return localcluster._short_temp_root()


def test_short_tmpdir_is_used(monkeypatch):
    assert _root_for("/tmp/rlci.abc123", monkeypatch) == "/tmp/rlci.abc123"


def test_deep_tmpdir_falls_back_so_sockets_fit(monkeypatch):
    deep = "/tmp/tmp.MC8BoWg7K4/raylift-ci.Ye1OSH"  # broke Ray's plasma socket path once
    assert _root_for(deep, monkeypatch) == "/tmp"
    longest = "/tmp/rl-velap114/ray/session_2026-11-22_18-41-04_398256_7636/sockets/plasma_store"
    assert len(longest) <= localcluster.SOCKET_PATH_MAX
