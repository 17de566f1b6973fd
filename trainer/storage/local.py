"""The node's own fast disk: the instance-store NVMe that a cluster node's boot formats and
mounts at /mnt/local_storage, handed to the container as RAYLIFT_LOCAL_STORAGE (infra's
userdata). Where it exists, the trainer's node-local scratch (checkpoint staging folders,
resume downloads, the model cache) goes there instead of the container's root disk; where
it does not (a laptop, CI, a node without instance store), the system's temp folder, as before.

Pure (no torch, no Ray): preflight and the doctor read it too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENV = "RAYLIFT_LOCAL_STORAGE"


def local_storage() -> Path | None:
    """The mounted local NVMe, or None where this node has none (or it is not writable)."""
    path = os.environ.get(ENV)
    if not path or not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return None
    return Path(path)


def scratch_root() -> Path:
    """Where node-local scratch folders go: the local NVMe's raylift folder, else TMPDIR."""
    local = local_storage()
    if local is None:
        return Path(tempfile.gettempdir())
    root = local / "raylift"
    root.mkdir(parents=True, exist_ok=True)
    return root


def scratch_dir(prefix: str) -> Path:
    """A fresh folder for one checkpoint's or one resume's files (the caller removes it)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=scratch_root()))
