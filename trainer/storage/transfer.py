"""Copying a local folder to its storage location: one file through pyarrow (raising when
any of it failed to arrive), many to S3 in parallel through boto3's transfer manager, and
the S3 clients built before the first step. Storage's own, beside `location.download_dir`
(the other direction): the checkpoint uploads (trainer.checkpoint.upload) and the trackers'
event files (trainer.observability.tracking) both copy folders through it.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainer.storage.location import Location, short_error

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
                raise OSError(f"S3 upload of {loc.uri}/{rel} failed: {short_error(exc)}") from exc


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
