"""`model:` where the weights come from, and the adapter that trains on them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.base import _Section


class LoraSection(_Section):
    r: int = Field(default=8, ge=1, description="Adapter rank.")
    alpha: float = Field(default=16.0, gt=0, description="Scale; the update is alpha/r × BA.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["auto", "all-linear"] = Field(
        default="auto",
        description="Module names that get adapters. auto: peft's default for the model's "
        "architecture where it has one, else every linear of the attention and MLP blocks "
        "(docs/models.md lists each family's); all-linear: every such linear.",
    )
    merge_on_export: bool = Field(
        default=False,
        description="Also export the base model with the adapter merged in (model_merged/).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list; give module names, or auto")
        return value


class ModelSection(_Section):
    path: str = Field(description="HF model folder: local dir, shared-FS dir, or s3:// URI.")
    tokenizer: str | None = Field(
        default=None, description="Tokenizer folder; defaults to the model folder."
    )
    special_tokens: str | None = Field(
        default=None,
        description='JSON file {"tokens": [...]} added to the tokenizer; embeddings resized.',
    )
    # flash_attention_2 is not offered: the GPU image's lock has no flash-attn package, and
    # a setting that can only fail on the cluster is worse than no setting. sdpa already
    # dispatches to a flash kernel on GPUs that have one (trainer.model.families).
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        default="auto",
        description="auto: sdpa where the model supports it in the pinned transformers, "
        "else eager (Gemma 2), resolved at preflight and printed in the plan. sdpa uses "
        "PyTorch's fused (flash) kernels where available; a model that cannot run it is "
        "refused at preflight.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward: less memory, ~30% slower."
    )
    adapter: Literal["none", "lora", "qlora"] = Field(
        default="none",
        description="none: train every weight. lora: train low-rank adapters on a frozen base "
        "loaded in the compute dtype. qlora: the same over a 4-bit nf4 base (bitsandbytes with "
        "ddp, torchao's NF4 sharded with fsdp).",
    )
    lora: LoraSection = Field(
        default_factory=LoraSection, description="Adapter options (lora/qlora)."
    )
