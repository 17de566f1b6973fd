"""Storage addressing: one function turns a config path into (pyarrow filesystem, path).

Local dirs, shared-FS mounts (EFS) and S3 (or an S3-compatible server through
`endpoint_override`) all go through pyarrow's filesystems, which Ray Train also uses, so
the trainer, Ray and the tools agree on where a run lives.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import io
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from trainer.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem
    path: str  # filesystem-relative: "bucket/prefix" for S3, absolute for local
    uri: str  # what the user wrote, normalised
    endpoint: str | None = None  # S3 only: the endpoint_override (boto3 uploads use it)
    region: str | None = None  # S3 only

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    def join(self, *parts: str) -> Location:
        path = "/".join([self.path.rstrip("/"), *parts])
        uri = "/".join([self.uri.rstrip("/"), *parts])
        return dataclasses.replace(self, path=path, uri=uri)


def s3_filesystem(
    endpoint_override: str | None = None, region: str | None = None
) -> pafs.S3FileSystem:
    """An S3 filesystem with short timeouts, so an unreachable endpoint fails in seconds."""
    kwargs: dict = {"connect_timeout": 5, "request_timeout": 30}
    if region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        kwargs["region"] = (
            region or os.environ.get("AWS_REGION") or os.environ["AWS_DEFAULT_REGION"]
        )
    if endpoint_override:
        scheme, _, host = endpoint_override.rpartition("://")
        kwargs["endpoint_override"] = host or endpoint_override
        kwargs["scheme"] = scheme or "https"
        kwargs.setdefault("region", "us-east-1")
        # S3-compatible servers (SeaweedFS, MinIO) want path-style addressing.
        kwargs["force_virtual_addressing"] = False
    return pafs.S3FileSystem(**kwargs)


def resolve(uri: str, endpoint_override: str | None = None, region: str | None = None) -> Location:
    if uri.startswith("s3://"):
        rest = uri[len("s3://") :].strip("/")
        if not rest:
            raise UserError(f"{uri}: an S3 path needs a bucket (s3://bucket/prefix)")
        return Location(
            s3_filesystem(endpoint_override, region),
            rest,
            "s3://" + rest,
            endpoint_override,
            region,
        )
    if "://" in uri:
        raise UserError(f"{uri}: unsupported scheme; use a local/shared-FS path or s3://")
    path = str(Path(uri).expanduser().resolve())
    return Location(pafs.LocalFileSystem(), path, path)


def check_writable(loc: Location) -> None:
    """Write and delete a probe object, so a wrong bucket or missing permission is caught
    before the job allocates workers."""
    # A name of its own: every rank of a torchrun job probes the same folder at once.
    probe = loc.join(
        f".raylift-write-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    try:
        loc.fs.create_dir(loc.path, recursive=True)
        with loc.fs.open_output_stream(probe.path) as f:
            f.write(b"ok")
        loc.fs.delete_file(probe.path)
    except OSError as exc:
        raise UserError(f"storage.path {loc.uri}: not writable: {_short(exc)}") from None


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def download_dir(loc: Location, dest: Path) -> Path:
    """Copy a remote folder to a local one, once per node: the ranks sharing a node take a
    file lock, the first downloads, the others find the finished copy."""
    marker = dest / ".raylift-complete"
    if marker.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(str(dest) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return dest
        dest.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s to %s (once for this node)", loc.uri, dest)
        try:
            pafs.copy_files(
                loc.path,
                str(dest),
                source_filesystem=loc.fs,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        except OSError as exc:
            raise UserError(f"{loc.uri}: cannot download: {_short(exc)}") from None
        marker.write_text("ok")
    return dest


_PUT_CHUNK = 8 << 20


def put_file(src: Path, fs: pafs.FileSystem, path: str) -> None:
    """Copy one local file to `fs`, raising if any of it failed to arrive. (pyarrow's
    copy_files does not: when an S3 part upload fails mid-file, the error is only printed
    as the stream is destroyed and copy_files returns as if the file were written, which
    would let a manifest vouch for a file that is not there.)"""
    with open(src, "rb") as f, fs.open_output_stream(path) as out:
        while chunk := f.read(_PUT_CHUNK):
            out.write(chunk)


def upload_dir(src: Path, loc: Location) -> None:
    files = sorted(p for p in src.rglob("*") if p.is_file())
    put_tree([(f, f.relative_to(src).as_posix()) for f in files], loc)


# S3 uploads go through boto3's transfer manager (s3transfer), not pyarrow's output stream:
# one file at a time through pyarrow reached 0.7 of a plain boto3 upload_file
# (tests/bench/test_bench_upload.py). The manager sends every file of a batch at once,
# each in parts, over one pool of connections; the part size and the pool are below.
S3_PART = 16 << 20
"""Multipart part size: 16 MiB keeps request overhead small and a 80 GB checkpoint far
below S3's 10,000-part limit per file (each rank's file is a share of it)."""
S3_CONCURRENCY = 16
"""Requests in flight per upload batch (files × parts)."""

_s3_clients: dict[tuple[str | None, str | None], Any] = {}
_s3_lock = threading.Lock()


def s3_client(endpoint: str | None, region: str | None) -> Any:
    """One boto3 S3 client per (endpoint, region) and process (clients are thread-safe),
    with the same short timeouts as `s3_filesystem` and few SDK retries: the checkpoint
    upload retries transient errors itself, with backoff and a journal record."""
    key = (endpoint, region)
    with _s3_lock:
        if key not in _s3_clients:
            import boto3
            from botocore.config import Config

            region = (
                region
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or ("us-east-1" if endpoint else None)
            )
            config = Config(
                connect_timeout=5,
                read_timeout=30,
                retries={"max_attempts": 2, "mode": "standard"},
                max_pool_connections=S3_CONCURRENCY + 4,
                s3={"addressing_style": "path"} if endpoint else None,
            )
            _s3_clients[key] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region, config=config
            )
        return _s3_clients[key]


def prepare_uploads(loc: Location) -> None:
    """Make this process's S3 client for `loc` and import the transfer manager now, before
    training starts. The first upload otherwise does it on a background thread in the
    middle of training: botocore parses its endpoint and S3 service models (about 0.4 s
    of Python, measured with py-spy on a worker) while holding the GIL the training
    thread needs, which made the step after the first checkpoint that much longer."""
    if not loc.is_s3:
        return
    for module in ("boto3.s3.transfer", "s3transfer.manager", "s3transfer.subscribers"):
        importlib.import_module(module)  # what put_files_s3 imports

    s3_client(loc.endpoint, loc.region)


def put_files_s3(
    files: list[tuple[Path, str]],
    loc: Location,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Upload (local file, key under `loc`) pairs to S3 in parallel, returning only when
    every one is stored; any failed part fails its file (s3transfer aborts the multipart
    upload and the future raises), raised here as an OSError naming the file, so the
    caller's transient/permanent classification and retries apply as for pyarrow.
    `on_progress(bytes)` is called from the transfer threads as parts go out."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from s3transfer.subscribers import BaseSubscriber

    class Progress(BaseSubscriber):
        def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
            if on_progress is not None:
                on_progress(bytes_transferred)

    bucket, _, prefix = loc.path.partition("/")
    config = TransferConfig(
        multipart_threshold=S3_PART,
        multipart_chunksize=S3_PART,
        max_concurrency=S3_CONCURRENCY,
        preferred_transfer_client="classic",
    )
    # The manager as a context: leaving it on an error cancels what is still queued
    # (its shutdown(cancel=True) is broken in s3transfer 0.19.3: it passes the flag as
    # the message), and leaving it normally waits for every transfer.
    with create_transfer_manager(s3_client(loc.endpoint, loc.region), config) as manager:
        futures = []
        for src, rel in files:
            key = f"{prefix.rstrip('/')}/{rel}" if prefix else rel
            futures.append((rel, manager.upload(str(src), bucket, key, subscribers=[Progress()])))
        for rel, future in futures:
            try:
                future.result()
            except Exception as exc:
                # Any failure is this file's: botocore's and s3transfer's errors are not
                # OSErrors; the text keeps what `is_transient` looks for.
                raise OSError(f"S3 upload of {loc.uri}/{rel} failed: {_short(exc)}") from exc


def put_tree(files: list[tuple[Path, str]], loc: Location) -> None:
    """Upload (local file, relative name) pairs under `loc`: S3 in parallel through
    boto3, other filesystems (local, shared FS) one by one through `put_file`."""
    if not files:
        return
    if loc.is_s3:
        put_files_s3(files, loc)
        return
    loc.fs.create_dir(loc.path, recursive=True)
    made: set[str] = set()
    for src, rel in files:
        parent = rel.rpartition("/")[0]
        if parent and parent not in made:
            loc.fs.create_dir(loc.join(parent).path, recursive=True)
            made.add(parent)
        put_file(src, loc.fs, loc.join(rel).path)


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
                _short(state.outcome.exception()),
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
    pause = float(os.environ.get("RAYLIFT_FAULT_UPLOAD_PAUSE_S", "0") or 0)

    def once() -> None:
        data = [p for p in ordered if p.relative_to(src).parts[0] != "done"]
        manifests = ordered[len(data) :]
        put_tree([(f, f.relative_to(src).as_posix()) for f in data], loc)
        if pause:
            log.warning("RAYLIFT_FAULT_UPLOAD_PAUSE_S: pausing %.1f s", pause)
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
            _short(exc),
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
            f"{_short(last)}"
        ) from None
    except OSError as exc:
        raise UploadError(f"checkpoint upload to {loc.uri} failed: {_short(exc)}") from None


def localize(uri: str, endpoint_override: str | None, region: str | None, cache_root: Path) -> Path:
    """Return a local path for a model/tokenizer folder; S3 folders are downloaded once per
    node into `cache_root` (keyed by URI), local and shared-FS paths are used in place."""
    if not uri.startswith("s3://"):
        path = Path(uri).expanduser()
        if not path.exists():
            raise UserError(f"{uri}: not found on this node (is the shared FS mounted?)")
        return path
    loc = resolve(uri, endpoint_override, region)
    key = hashlib.sha256(loc.uri.encode()).hexdigest()[:16]
    return download_dir(loc, cache_root / key)


def read_text(uri: str, endpoint_override: str | None = None, region: str | None = None) -> str:
    loc = resolve(uri, endpoint_override, region)
    try:
        with loc.fs.open_input_stream(loc.path) as f:
            return f.read().decode()
    except FileNotFoundError:
        raise UserError(f"{uri}: not found") from None
    except OSError as exc:
        raise UserError(f"{uri}: cannot read: {_short(exc)}") from None
