"""Logging setup shared by the CLI, the driver and the workers."""

from __future__ import annotations

import logging
import os


def setup_logging(debug: bool = False) -> None:
    level = logging.DEBUG if debug or os.environ.get("RAYLIFT_DEBUG") else logging.INFO
    root = logging.getLogger()
    if not any(getattr(h, "_raylift", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        handler._raylift = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    # Our loggers speak at INFO; libraries (Ray Train's per-report chatter) only at WARNING.
    root.setLevel(logging.DEBUG if level == logging.DEBUG else logging.WARNING)
    for ours in ("trainer", "raylift"):
        logging.getLogger(ours).setLevel(level)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    for noisy in ("urllib3", "filelock", "httpx", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
