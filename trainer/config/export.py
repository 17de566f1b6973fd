"""`export:` the formats each export is written in, besides the Hugging Face folder."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainer.config.base import _Section

EXPORT_FORMATS = ("hf", "gguf")
GGUF_TYPES = ("f16", "q8_0", "f32")
GGUF_MODEL_TYPES = ("llama",)
"""The config.json model_types trainer.checkpoint.gguf_export writes (its name map and
rotary layout are llama.cpp's `llama` graph's); preflight refuses others before launch."""


class ExportSection(_Section):
    formats: list[Literal["hf", "gguf"]] = Field(
        default_factory=lambda: ["hf"],
        description="What each export (export/step_<N>/) holds. hf: the Hugging Face folder "
        "(model/, or adapter/ and with merge_on_export model_merged/), always written. gguf: "
        "also gguf/<name>-<type>.gguf for llama.cpp, one per gguf_types, from the full "
        "folder (Llama-family models; adapters need model.lora.merge_on_export). Every file "
        "is loaded back and its logits checked before upload (docs/production.md).",
    )
    gguf_types: list[Literal["f16", "q8_0", "f32"]] = Field(
        default_factory=lambda: ["f16", "q8_0"],
        description="With gguf in formats: the GGUF weight types written, one file each. "
        "f16; q8_0 (8-bit blocks, about half of f16's size); f32.",
    )

    @field_validator("formats")
    @classmethod
    def _hf_always(cls, value: list[str]) -> list[str]:
        if "hf" not in value:
            raise ValueError(
                "the Hugging Face folder is always written (GGUF is made from it and checked "
                "against it); list hf, e.g. [hf, gguf]"
            )
        return list(dict.fromkeys(value))

    @field_validator("gguf_types")
    @classmethod
    def _some_types(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("an empty list; give at least one of f16, q8_0, f32")
        return list(dict.fromkeys(value))
