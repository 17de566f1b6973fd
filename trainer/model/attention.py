"""The attention a worker builds its model with, and what the document mask must carry
for it: one answer per job, read once per process from the model folder's config.

Preflight already resolved `model.attn_implementation` (trainer.model.families) on the
laptop and on the driver, and refused what cannot run; this is the same resolution on
the worker, from the same table, with transformers' own flag consulted only for a
family the table does not know.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import JobConfig
from trainer.model import families, hfconfig
from trainer.model.folders import local_model_dir


@dataclass(frozen=True)
class Attention:
    impl: str
    """What from_pretrained / from_config get as attn_implementation (sdpa or eager)."""
    window: int | None = None
    """The sliding window the document mask keeps (None: none)."""
    per_layer_type: bool = False
    """Full and sliding layers, each taking its own mask."""

    def mask_kwargs(self) -> dict[str, Any]:
        return {"window": self.window, "per_layer_type": self.per_layer_type}


def _transformers_supports_sdpa(mconf: dict[str, Any]) -> bool:
    """For a family outside the table: the causal-LM class's own flag."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    conf = AutoConfig.for_model(**mconf)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(conf))
    return bool(getattr(cls, "_supports_sdpa", True))


def resolve(requested: str, mconf: dict[str, Any], where: str = "config.json") -> Attention:
    """The kernel and the mask's shape for a model whose config.json is `mconf`. The
    window and layer types are read as transformers reads them (its config class fills
    layer_types, and drops a Qwen window that use_sliding_window turns off)."""
    impl = families.resolve_attention(requested, mconf, where)
    if requested == "auto" and families.family(mconf) is None:
        try:
            impl = "sdpa" if _transformers_supports_sdpa(mconf) else "eager"
        except Exception:  # an unknown architecture: from_pretrained says what is wrong
            impl = "sdpa"
    from transformers import AutoConfig

    conf = AutoConfig.for_model(**mconf)
    conf = getattr(conf, "text_config", None) or conf
    window = getattr(conf, "sliding_window", None)
    types = list(getattr(conf, "layer_types", None) or [])
    per_type = "sliding_attention" in types
    if types and not per_type:
        window = None  # every layer is full: the number is unused
    return Attention(impl, int(window) if window else None, per_type)


@functools.cache
def _for_folder(requested: str, model_dir: str) -> Attention:
    return resolve(requested, hfconfig.read_local(Path(model_dir)), model_dir)


def for_job(cfg: JobConfig, model_dir: Path | None = None) -> Attention:
    """This job's attention, from the (local copy of the) model folder."""
    if model_dir is None:
        model_dir = local_model_dir(cfg)
    return _for_folder(cfg.model.attn_implementation, str(model_dir))
