"""Storage addressing: one function turns a config path into (pyarrow filesystem, path).

Local dirs, shared-FS mounts (EFS) and S3 (or an S3-compatible server through
`endpoint_override`) all go through pyarrow's filesystems, which Ray Train also uses, so
the trainer, Ray and the tools agree on where a run lives.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

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
        raise UserError(f"storage.path {loc.uri}: not writable: {short_error(exc)}") from None


def short_error(exc: BaseException) -> str:
    """An error's first line (at most 300 characters): what one-line messages quote."""
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
            raise UserError(f"{loc.uri}: cannot download: {short_error(exc)}") from None
        marker.write_text("ok")
    return dest


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
        raise UserError(f"{uri}: cannot read: {short_error(exc)}") from None
