"""Checkpoint upload throughput to S3 (a SeaweedFS server on 127.0.0.1): Raylift's
checkpoint upload (trainer.checkpoint.upload.upload_checkpoint: data files first, manifests last,
retries on transient errors) against a plain boto3 multipart upload (upload_file, its
default TransferConfig) of the same files. Target: Raylift ≥ 0.9 of boto3's MB/s.

The checkpoint is shaped like a DDP one: a large model file, a larger optimizer file,
small scheduler/RNG/state files and a manifest. Size: RAYLIFT_BENCH_UPLOAD_MB (default
256 MB in all)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.bench.benchutil import Check, run_benchmark, size
from tests.support.s3 import S3_KEY, S3_SECRET, WeedServer
from trainer.checkpoint.manager import write_manifest
from trainer.checkpoint.upload import upload_checkpoint
from trainer.storage.location import resolve


def _checkpoint(root: Path, total_mb: int) -> tuple[Path, int]:
    out = root / "ckpt"
    (out / "strategy").mkdir(parents=True)
    (out / "rng").mkdir()
    model = total_mb * 1024 * 1024 // 3
    sizes = {
        "strategy/model.pt": model,
        "strategy/optimizer.pt": 2 * model,
        "scheduler.pt": 1024,
        "rng/rank_0.pt": 6 * 1024,
        "trainer_state.json": 512,
    }
    for rel, n in sizes.items():
        with open(out / rel, "wb") as f:
            f.write(os.urandom(n))
    write_manifest(out, 0, before=set())
    return out, sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def test_upload_throughput_matches_plain_boto3(tmp_path):
    total_mb = size("RAYLIFT_BENCH_UPLOAD_MB", 256, 8)
    server = WeedServer(tmp_path / "weed")
    (tmp_path / "weed").mkdir()
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = S3_KEY, S3_SECRET
    server.start()
    try:
        src, nbytes = _checkpoint(tmp_path, total_mb)
        files = sorted(p for p in src.rglob("*") if p.is_file())

        def raylift(i: int) -> dict[str, float]:
            loc = resolve(f"s3://ckpt/raylift/{i}", server.endpoint)
            t0 = time.perf_counter()
            upload_checkpoint(src, loc, retry_s=60)
            return {"mb_s": nbytes / 1e6 / (time.perf_counter() - t0)}

        def boto3_plain(i: int) -> dict[str, float]:
            t0 = time.perf_counter()
            for f in files:
                key = f"boto3/{i}/{f.relative_to(src).as_posix()}"
                server.client.upload_file(str(f), "ckpt", key)
            return {"mb_s": nbytes / 1e6 / (time.perf_counter() - t0)}

        run_benchmark(
            "upload",
            title=f"Checkpoint upload to S3 (SeaweedFS, {nbytes / 1e6:.0f} MB)",
            commands={"raylift": raylift, "boto3": boto3_plain},
            checks=[
                Check(
                    "raylift_vs_boto3",
                    lambda r: r["raylift"]["mb_s"] / r["boto3"]["mb_s"],
                    0.9,
                ),
                Check("raylift_mb_s", lambda r: r["raylift"]["mb_s"], unit="MB/s"),
                Check("boto3_mb_s", lambda r: r["boto3"]["mb_s"], unit="MB/s"),
            ],
            metric="mb_s",
            unit="MB/s",
            setup={"bytes": nbytes, "files": len(files)},
        )
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
