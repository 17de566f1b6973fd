"""The oneCCL worker preparation (trainer.runtime.ccl), without Ray: environment and import."""

from __future__ import annotations

import pytest

from trainer.errors import UserError
from trainer.runtime.ccl import BINDINGS, OneCCLConfig, default_env, prepare_worker


def test_missing_bindings_is_one_line_naming_the_ccl_image(monkeypatch):
    monkeypatch.setenv("FI_PROVIDER", "tcp")
    with pytest.raises(UserError, match=f"{BINDINGS} is not installed.*the ccl image"):
        prepare_worker(BINDINGS, default_env())


def test_environment_is_set_before_the_import(monkeypatch, tmp_path):
    """A stand-in bindings module (the real one cannot install on torch 2.13) records the
    environment it was imported under, as oneCCL reads it when its bindings load."""
    import sys

    (tmp_path / "ccl_probe_bindings.py").write_text(
        "import os\nSEEN = {k: os.environ.get(k) for k in ('FI_PROVIDER', 'CCL_WORKER_COUNT')}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("FI_PROVIDER", "CCL_WORKER_COUNT", "CCL_LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    out = prepare_worker("ccl_probe_bindings", {"FI_PROVIDER": "tcp", "CCL_WORKER_COUNT": "1"})
    assert sys.modules["ccl_probe_bindings"].SEEN == {"FI_PROVIDER": "tcp", "CCL_WORKER_COUNT": "1"}
    assert out["CCL_LOCAL_RANK"] == "0"
    monkeypatch.delitem(sys.modules, "ccl_probe_bindings")


def test_config_defaults_to_ccl():
    c = OneCCLConfig()
    assert c.backend == "ccl" and c.bindings == BINDINGS and c.env["FI_PROVIDER"]
