"""Where a worker finds the job's model and tokenizer folders: local paths as they are,
s3:// ones downloaded once per node into the model cache.

Its own module, below both loading and attention: the attention a worker builds with is read
from the model folder's config, and loading builds the model with that attention, so neither
imports the other to learn where the folder is. No torch here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from trainer.config import JobConfig
from trainer.storage.local import local_storage

_LOCAL = local_storage()
MODEL_CACHE = Path(
    os.environ.get("RAYLIFT_MODEL_CACHE")
    or (_LOCAL or Path(tempfile.gettempdir())) / "raylift" / "models"
)
"""Downloaded models: the node's local NVMe where it has one (a 70B base is 140 GB), else
the temp folder; RAYLIFT_MODEL_CACHE overrides both."""


def local_model_dir(cfg: JobConfig) -> Path:
    """The model folder on this node (downloaded into MODEL_CACHE when remote)."""
    from trainer.storage.location import localize

    return localize(cfg.model.path, cfg.storage.endpoint_override, cfg.storage.region, MODEL_CACHE)


def local_tokenizer_dir(cfg: JobConfig) -> Path:
    """The tokenizer folder on this node: model.tokenizer, else the model's own folder."""
    if cfg.model.tokenizer is None:
        return local_model_dir(cfg)
    from trainer.storage.location import localize

    return localize(
        cfg.model.tokenizer, cfg.storage.endpoint_override, cfg.storage.region, MODEL_CACHE
    )
