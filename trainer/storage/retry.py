"""Transient storage errors retried, permanent ones said in one line: a pyarrow filesystem
wrapper that Ray Train's own checkpoint uploads go through too.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from trainer.errors import UserError
from trainer.storage.location import short_error

log = logging.getLogger(__name__)


_PERMANENT = (
    "AccessDenied",
    "Access Denied",
    "NoSuchBucket",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "Forbidden",
    "Permission denied",
    "No space left",
    "Read-only file system",
)


class UploadError(UserError):
    """A checkpoint upload that failed for good (a permanent error, or transient ones
    past the retry budget): the checkpoint is not recorded, the previous one stays."""


# What storage answered about a path, not a failure to reach it: never worth a retry.
_ANSWERS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Storage errors worth retrying: throttling, a server briefly down or unreachable,
    timeouts. Missing permissions, buckets or space are not, whatever the SDK says."""
    if not isinstance(exc, OSError) or isinstance(exc, _ANSWERS):
        return False
    text = str(exc)
    return not any(p in text for p in _PERMANENT)


def transient_retries(
    retry_s: float, max_wait_s: float, before_sleep: Callable[[Any], None], reraise: bool
) -> Any:
    """Retry transient storage errors (`is_transient`) with exponential backoff from 0.5 s
    up to `max_wait_s` between tries, for `retry_s` seconds in all."""
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

    return Retrying(
        stop=stop_after_delay(retry_s),
        wait=wait_exponential(multiplier=0.5, max=max_wait_s),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=reraise,
    )


class _BufferedWrite(io.RawIOBase):
    """An output stream that writes its object in one go when closed, retrying transient
    errors: a storage blip between open and close is then retried too."""

    def __init__(self, fs: pafs.FileSystem, path: str, retry: Callable[..., Any]):
        self._fs, self._path, self._retry = fs, path, retry
        self._buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._buf.write(data)

    def close(self) -> None:
        if self.closed:
            return
        body = self._buf.getvalue()

        def put() -> None:
            with self._fs.open_output_stream(self._path) as f:
                f.write(body)

        self._retry(put)
        super().close()


class RetryingHandler(pafs.FileSystemHandler):
    """A filesystem that retries transient errors (throttling, a server briefly down) of
    every call with backoff, for up to `retry_s` seconds. Ray Train gets its storage
    through it, so the controller's own writes (its checkpoint registry) survive the same
    blips as Raylift's uploads. Writes are buffered and sent at close: meant for the small
    files Ray writes itself; checkpoints go through `upload_checkpoint`."""

    def __init__(self, fs: pafs.FileSystem, retry_s: float):
        self.fs = fs
        self.retry_s = retry_s

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RetryingHandler)
            and self.fs.equals(other.fs)
            and self.retry_s == other.retry_s
        )

    def __hash__(self) -> int:
        return hash((self.fs.type_name, self.retry_s))

    def __reduce__(self) -> Any:
        return (RetryingHandler, (self.fs, self.retry_s))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        def note(state: Any) -> None:
            log.warning(
                "storage call %s failed (try %d): %s; retrying",
                getattr(fn, "__name__", fn),
                state.attempt_number,
                short_error(state.outcome.exception()),
            )

        for attempt in transient_retries(self.retry_s, 10, note, reraise=True):
            with attempt:
                return fn(*args)
        raise AssertionError("unreachable")

    def get_type_name(self) -> str:
        return f"retrying+{self.fs.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> Any:
        return self._call(self.fs.get_file_info, paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> Any:
        return self._call(self.fs.get_file_info, selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self._call(lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path: str) -> None:
        self._call(self.fs.delete_dir, path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._call(lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to delete the storage root's contents")

    def delete_file(self, path: str) -> None:
        self._call(self.fs.delete_file, path)

    def move(self, src: str, dest: str) -> None:
        self._call(self.fs.move, src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._call(self.fs.copy_file, src, dest)

    def open_input_stream(self, path: str) -> Any:
        # Whole-object reads: Ray reads its small state files; a retry re-reads.
        data = self._call(lambda: self.fs.open_input_stream(path).read())
        return pa.BufferReader(data)

    def open_input_file(self, path: str) -> Any:
        data = self._call(lambda: self.fs.open_input_file(path).read())
        return pa.BufferReader(data)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return pa.PythonFile(_BufferedWrite(self.fs, path, self._call), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self._call(lambda: self.fs.open_append_stream(path))


def retrying(fs: pafs.FileSystem, retry_s: float) -> pafs.FileSystem:
    return pafs.PyFileSystem(RetryingHandler(fs, retry_s))
