"""Logging setup: cheap for the job driver, quiet for the libraries."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.jobs import ROOT

PROBE = """
import json, os, sys
os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
from trainer.observability.logs import setup_logging
setup_logging()
loaded = "transformers" in sys.modules
from transformers.utils import logging as hf_logging
import huggingface_hub.utils as hub
print(json.dumps({"loaded": loaded, "hf_bars": hf_logging.is_progress_bar_enabled(),
                  "hub_bars": not hub.are_progress_bars_disabled()}))
"""


def test_setup_logging_imports_no_transformers_and_still_silences_its_bars():
    """A job driver that finds its token cache must not pay transformers' import (~2 s of
    every job) just to turn off its progress bars; transformers imported afterwards still
    starts with them off."""
    res = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"loaded": False, "hf_bars": False, "hub_bars": False}, got


def test_setup_logging_silences_an_already_imported_transformers():
    from transformers.utils import logging as hf_logging

    from trainer.observability.logs import setup_logging

    hf_logging.enable_progress_bar()
    setup_logging()
    assert not hf_logging.is_progress_bar_enabled()
