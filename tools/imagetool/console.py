"""Where the image tool talks: logs and progress on stderr, so stdout carries only results
(the plan, pushed digests, written locks) and can be piped."""

from __future__ import annotations

import logging
from typing import Any


def stderr_console() -> Any:
    """A rich console on stderr (rich comes with the tools extra)."""
    from rich.console import Console

    return Console(stderr=True)


def setup_logging(debug: bool) -> None:
    try:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=stderr_console(), show_path=False, show_time=False
        )
        fmt = "%(message)s"
    except ImportError:  # the tools extra is missing; plain logs still work
        handler = logging.StreamHandler()
        fmt = "%(levelname)s %(message)s"
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format=fmt,
                        handlers=[handler], force=True)  # fmt: skip
    for noisy in ("urllib3", "botocore", "boto3", "docker"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
