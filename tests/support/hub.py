"""A Hugging Face Hub cache built in huggingface_hub's documented layout, for tests that
resolve Hub ids offline (HF_HUB_OFFLINE=1): blobs/ named by hash, snapshots/<commit>/
linking to them, refs/main naming the commit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes], n: int = 0) -> str:
    """One commit of a repository in `cache`; refs/main points at it. Returns its hash."""
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    sha = hashlib.sha1(f"{repo_id}{n}".encode()).hexdigest()
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / sha / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(sha)
    return sha


def model_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def card(split_patterns: dict[str, str]) -> bytes:
    """A dataset card whose one config maps each split to its file pattern."""
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, pattern in split_patterns.items():
        lines += [f"  - split: {split}", f"    path: {pattern}"]
    return ("\n".join([*lines, "---", "# test data", ""])).encode()
