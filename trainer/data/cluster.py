"""Tokenizing on the cluster: one Ray Data task per input file, spread over every node's
CPUs, each writing its own shard into the cache folder on the shared FS.

The shards and the manifest are the same files `trainer.data.tokenize.tokenize_local` writes, named
by the file's place in the sorted input list, so the token stream (and every block, and
resume) does not depend on which node tokenized which file, or on how many there were.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trainer.data.sources import SourceFile
from trainer.data.tokenize import Settings, ShardStats, ShippedTokenizer, tokenize_file
from trainer.errors import DataError, UserError

log = logging.getLogger(__name__)

# What a task needs from the driver's environment to read S3 where nodes have no
# instance role (an S3-compatible server, a laptop cluster); the same set Ray Train
# workers get.
_PASS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
)


def _tokenize_row(
    row: dict[str, Any], folder: str, tokenizer: Any, settings: Settings
) -> dict[str, Any]:
    """One file → one shard. A bad row comes back as data, not as an exception, so the
    driver can name the first bad file in input order in one line."""
    import ray

    src = SourceFile(row["uri"], row["size"], row["mtime_ns"])
    out: dict[str, Any] = {"index": row["index"], "error": "", "stats": ""}
    try:
        # One CPU per task, so one thread of work: no reading ahead in a second thread.
        stats = tokenize_file(
            src, f"shard-{row['index']:05d}", Path(folder), tokenizer, settings, overlap=False
        )
        out["stats"] = _dump(stats)
    except UserError as exc:  # a bad row, or a chat row with no template: one line
        out["error"] = str(exc)
    out["node"] = ray.get_runtime_context().get_node_id()
    return out


def _dump(stats: ShardStats) -> str:
    import json
    from dataclasses import asdict

    return json.dumps(asdict(stats))


def _task_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    # One tokenizer thread per task: the cluster's parallelism is one task per CPU.
    env.update(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="true")
    return env


def tokenize_on_cluster(
    sources: list[SourceFile], folder: Path, tokenizer: Any, settings: Settings, progress: bool
) -> list[ShardStats]:
    """The engine for `trainer.data.tokenize.prepare` on a Ray cluster. `folder` must be on a
    filesystem every node mounts at the same path (the shared FS)."""
    import json

    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    items = [
        {"index": i, "uri": s.uri, "size": s.size, "mtime_ns": s.mtime_ns}
        for i, s in enumerate(sources)
    ]
    log.info("tokenizing %d files with Ray Data across the cluster", len(sources))
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map(
        _tokenize_row,
        fn_kwargs={
            "folder": str(folder),
            "tokenizer": ShippedTokenizer(tokenizer),
            "settings": settings,
        },
        num_cpus=1,
        runtime_env={"env_vars": _task_env()},
    )
    rows = sorted(ds.take_all(), key=lambda r: r["index"])
    for r in rows:
        if r["error"]:
            raise DataError(r["error"])
    nodes = sorted({r["node"] for r in rows})
    log.info("tokenized %d files on %d nodes", len(rows), len(nodes))
    out = []
    for r in rows:
        stats = ShardStats(**json.loads(r["stats"]))
        stats.node = r["node"]
        out.append(stats)
    return out
