"""Checkpoint uploads: a folder to its storage location, data files first and manifests
last, retrying transient errors. The copying itself (files, S3 in parallel, the S3 clients
built before the first step) is storage's, in trainer.storage.transfer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import faults
from trainer.storage.location import Location, short_error
from trainer.storage.retry import UploadError, transient_retries
from trainer.storage.transfer import put_file as put_file  # tests/integration/test_faults
from trainer.storage.transfer import put_files_s3 as put_files_s3  # imports both from here
from trainer.storage.transfer import put_tree

log = logging.getLogger(__name__)


def upload_checkpoint(
    src: Path,
    loc: Location,
    retry_s: float,
    on_retry: Callable[[int, BaseException], None] | None = None,
    before_manifests: Callable[[], None] | None = None,
) -> int:
    """Copy a checkpoint folder to storage so that it can never look complete early: the
    data files first, the rank manifests (`done/`) last. Transient errors are retried with
    exponential backoff for up to `retry_s` seconds, re-copying the whole folder (an object
    store has no partial objects, a file system's partial file has the wrong size, and a
    manifest lists sizes). Returns the number of attempts it took. `before_manifests` runs
    between the two on every try (the fault drills hold the upload there)."""
    from tenacity import RetryError

    files = sorted(p for p in src.rglob("*") if p.is_file())
    ordered = [p for p in files if p.relative_to(src).parts[0] != "done"] + [
        p for p in files if p.relative_to(src).parts[0] == "done"
    ]

    # Fault injection for the test suite and for chaos drills on a real cluster: hold the
    # upload between the data files and the manifests, the window a kill or a storage
    # outage must not turn into a checkpoint that looks complete.
    pause = faults.upload_pause_s()

    def once() -> None:
        data = [p for p in ordered if p.relative_to(src).parts[0] != "done"]
        manifests = ordered[len(data) :]
        put_tree([(f, f.relative_to(src).as_posix()) for f in data], loc)
        if pause:
            log.warning("%s: pausing %.1f s", faults.UPLOAD_PAUSE_ENV, pause)
            time.sleep(pause)
        if before_manifests is not None:
            before_manifests()
        put_tree([(f, f.relative_to(src).as_posix()) for f in manifests], loc)

    def note(state: Any) -> None:
        exc = state.outcome.exception()
        log.warning(
            "checkpoint upload to %s failed (try %d): %s; retrying",
            loc.uri,
            state.attempt_number,
            short_error(exc),
        )
        if on_retry is not None:
            on_retry(state.attempt_number, exc)

    retrying = transient_retries(retry_s, 15, note, reraise=False)
    try:
        for attempt in retrying:
            with attempt:
                once()
        return retrying.statistics.get("attempt_number", 1)
    except RetryError as exc:
        last = exc.last_attempt.exception()
        raise UploadError(
            f"checkpoint upload to {loc.uri} still failing after {retry_s:.0f} s of retries: "
            f"{short_error(last)}"
        ) from None
    except OSError as exc:
        raise UploadError(f"checkpoint upload to {loc.uri} failed: {short_error(exc)}") from None
