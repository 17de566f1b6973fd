"""The runs under a storage path, as the planner reads them from a laptop: a local or
shared-FS folder with the standard library, s3:// with boto3 (the tools extra; imported only
then: pyarrow, the trainer's S3 client, is not installed on the laptop that plans).

Its own module because two rungs read storage beside the runs: the history of past runs
(trainer.planner.history) and the calibration file `make gpu-check` wrote
(trainer.planner.calibration); neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path


class Unreadable(Exception):
    """The storage path's runs could not be listed or read (what, where: one line)."""


class _LocalRuns:
    def __init__(self, root: str):
        self.root = Path(root).expanduser()

    def runs(self) -> Iterator[tuple[str, str, list[str]]]:
        """(run name, job.json's text, each device_memory/rank*.json's text), per run."""
        if not self.root.is_dir():
            return
        for job_file in sorted(self.root.glob("*/job.json")):
            run = job_file.parent
            finals = [f.read_text() for f in sorted(run.glob("device_memory/rank*.json"))]
            yield run.name, job_file.read_text(), finals


class S3Runs:
    """The same listing over S3 with boto3: one request for the runs, two per run. Its
    public methods (`folders`, `objects`, `text`) are what other readers of the runs use
    (the past runs' journals, trainer.planner.fault_history): botocore's errors come
    out as `Unreadable`, one line."""

    def __init__(self, uri: str, endpoint: str | None, region: str | None):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise Unreadable(
                f"{uri}: past runs not read (boto3 is not installed here: pip install "
                "'raylift[tools]')"
            ) from None
        self.uri = uri.rstrip("/")
        bucket, _, prefix = uri[len("s3://") :].strip("/").partition("/")
        self.bucket, self.prefix = bucket, f"{prefix}/" if prefix else ""
        style = {"addressing_style": "path"} if endpoint else {}
        conf = Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=5,
            read_timeout=20,
            s3=style,
        )
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region, config=conf)

    def _keys(self, prefix: str, folders: bool = False) -> list[str]:
        out: list[str] = []
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **({"Delimiter": "/"} if folders else {})
        )
        for page in pages:
            if folders:
                out += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            else:
                out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def _text(self, key: str) -> str:
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read().decode()

    def text(self, rel: str) -> str | None:
        """The text of `rel` under the storage path; None when there is no such object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._text(self.prefix + rel)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise Unreadable(f"{self.uri}/{rel}: not read: {exc}") from None
        except BotoCoreError as exc:
            raise Unreadable(f"{self.uri}/{rel}: not read: {exc}") from None

    def folders(self) -> list[str]:
        """The names of the folders directly under the storage path (a run each)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            keys = self._keys(self.prefix, folders=True)
        except (BotoCoreError, ClientError) as exc:
            raise Unreadable(f"{self.uri}: past runs not read: {exc}") from None
        return [k[len(self.prefix) :].rstrip("/") for k in keys]

    def objects(self, rel: str) -> list[tuple[str, datetime]]:
        """(path under the storage path, last modified) of each object under `rel`."""
        from botocore.exceptions import BotoCoreError, ClientError

        out: list[tuple[str, datetime]] = []
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + rel
            )
            for page in pages:
                out += [
                    (o["Key"][len(self.prefix) :], o["LastModified"])
                    for o in page.get("Contents", [])
                ]
        except (BotoCoreError, ClientError) as exc:
            raise Unreadable(f"{self.uri}/{rel}: not listed: {exc}") from None
        return sorted(out)

    def runs(self) -> Iterator[tuple[str, str, list[str]]]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for folder in self._keys(self.prefix, folders=True):
                try:
                    job = self._text(folder + "job.json")
                except ClientError:  # no job record: not a run the planner can plan again
                    continue
                finals = [
                    self._text(k)
                    for k in self._keys(folder + "device_memory/")
                    if k.rsplit("/", 1)[-1].startswith("rank") and k.endswith(".json")
                ]
                yield folder[len(self.prefix) :].rstrip("/"), job, finals
        except (BotoCoreError, ClientError) as exc:
            raise Unreadable(f"{self.uri}: past runs not read: {exc}") from None


def s3_text(uri: str, rel: str, endpoint: str | None, region: str | None) -> str | None:
    """An object's text under an s3:// storage path (None: no such object); Unreadable when
    S3 cannot be asked. What the planner reads beside the runs (the calibration file)."""
    return S3Runs(uri, endpoint, region).text(rel)
