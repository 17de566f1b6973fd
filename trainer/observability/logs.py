"""Logging setup shared by the CLI, the driver and the workers."""

from __future__ import annotations

import json
import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not to the stream it saw
    when it was made: a process that calls setup_logging and later swaps stderr (a test
    capture, a notebook cell, a CLI run twice in one process) never writes to a closed one."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(debug: bool = False, ray_worker: bool = False) -> None:
    """Our loggers ("trainer", "raylift") speak at INFO, libraries only at WARNING.

    In a Ray Train worker, Ray already routes the root logger to the console and to the
    run's log files (and mirrors stderr into it), so our loggers only propagate there: a
    handler of our own would print every line twice. Elsewhere they get their own
    timestamped handler and do not propagate.
    """
    level = logging.DEBUG if debug or os.environ.get("RAYLIFT_DEBUG") else logging.INFO
    for name in ("trainer", "raylift"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = ray_worker
        if ray_worker or any(getattr(h, "_raylift", False) for h in logger.handlers):
            continue
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
        handler._raylift = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    if not ray_worker:
        root = logging.getLogger()
        root.setLevel(logging.DEBUG if level == logging.DEBUG else logging.WARNING)
        if not root.handlers:
            root.addHandler(logging.StreamHandler())
    _no_library_progress_bars()
    for noisy in ("urllib3", "filelock", "httpx", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if ray_worker:
        _quiet_ray_train_reports()


def _no_library_progress_bars() -> None:
    """No per-file download/load bars from Hugging Face's libraries (ours are enough).
    Through the environment variable they read when first imported, so this costs no
    import: a job driver that finds its token cache never loads transformers (~2 s);
    libraries a process already imported are told directly."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _quiet_ray_train_reports() -> None:
    """Ray Train V2 logs every `ray.train.report` of every rank at INFO ("Reporting
    training result N: …", the whole metrics dict). The loop's own step line already says
    it once, so keep only Ray's warnings from that module. (Its logger is named after its
    file path, so it is found through the module.)"""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    context.logger.setLevel(logging.WARNING)


# What a driver hands back to the CLI travels as one marked JSON line in the job's log:
# the run's summary, the cluster doctor's result (trainer.runtime.doctor.MARK).
SUMMARY_MARK = "RAYLIFT_SUMMARY "


def print_marked(mark: str, payload: dict, stream=None) -> None:
    """Write `mark` and the payload's JSON with one write call, its newline included. A
    driver's stdout is shared with Ray's log thread, which prints the workers' lines there;
    print() writes the text and its newline separately, and such a line could land in
    between (a fresh-clone CI run saw the summary's JSON followed by another line's text).
    The start of another line can still come first: find_marked looks anywhere in a line."""
    stream = stream if stream is not None else sys.stdout
    stream.write(mark + json.dumps(payload, default=str) + "\n")
    stream.flush()


def find_marked(line: str, mark: str) -> tuple[dict | None, str]:
    """The payload a log line carries after `mark`, and the rest of the line (what another
    writer put before or after it). (None, line) where the line has no payload, or one cut
    short."""
    at = line.find(mark)
    if at < 0:
        return None, line
    try:
        payload, end = json.JSONDecoder().raw_decode(line, at + len(mark))
    except ValueError:
        return None, line
    if not isinstance(payload, dict):
        return None, line
    return payload, line[:at] + line[end:]
