"""`strategy:` one typed section per strategy (ddp, fsdp, deepspeed), told apart by `name`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from trainer.config.base import _Section

SP_DESCRIPTION = (
    "Sequence-parallel size (Ulysses): each sequence is split over this many consecutive "
    "workers, attention runs on whole sequences through an all-to-all over heads; "
    "data-parallel replicas = workers / sp. Must divide the workers and the model's KV heads."
)


class DDPOptions(_Section):
    """Every rank holds the whole model; gradients are all-reduced."""

    name: Literal["ddp"] = Field(default="ddp", description="Data parallel: whole model per rank.")
    sp: int = Field(default=1, ge=1, description=SP_DESCRIPTION)


class FSDPOptions(_Section):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks."""

    name: Literal["fsdp"] = Field(description="FSDP2 (fully_shard) per decoder layer, then root.")
    layer_class: str | None = Field(
        default=None,
        description="Decoder layer class to shard on; null = found from the model "
        "(LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, GPTNeoXLayer, ...).",
    )
    reshard_after_forward: bool = Field(
        default=True, description="Free gathered layer weights after forward (ZeRO-3-like)."
    )
    cpu_offload: bool = Field(
        default=False, description="Keep sharded params, grads and optimizer state in CPU RAM."
    )
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each decoder layer's activations in backward."
    )
    tp: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel size: each decoder layer's matrices split over this many "
        "workers (keep it inside one node); attention and KV heads must divide by it.",
    )
    pp: int = Field(
        default=1,
        ge=1,
        description="Pipeline-parallel size: the decoder layers split into this many groups "
        "of workers that pass activations on; the rest (workers / (tp × pp)) is FSDP.",
    )
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe", "zbv"] = Field(
        default="1f1b",
        description="Pipeline schedule; interleaved_1f1b and zbv hold two stages per worker "
        "(a smaller bubble, microbatches a multiple of pp).",
    )
    sp: int = Field(default=1, ge=1, description=SP_DESCRIPTION)
    microbatches: int | None = Field(
        default=None,
        ge=1,
        description="Pipeline microbatches each micro batch is cut into; null = pp. Must "
        "divide train.micro_batch_size.",
    )

    @property
    def model_parallel(self) -> int:
        """Workers that hold one replica of the model between them (tp × pp)."""
        return self.tp * self.pp

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in ("interleaved_1f1b", "zbv") else 1

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp


class DeepSpeedOptions(_Section):
    """DeepSpeed ZeRO-2/3 (with CPU/NVMe offload) from a stock DeepSpeed JSON."""

    name: Literal["deepspeed"] = Field(description="DeepSpeed ZeRO through its engine.")
    config: str = Field(
        default="zero3",
        description="Shipped config (zero2, zero3, zero3_offload) or a path to a DeepSpeed JSON; "
        '"auto" values are filled from this job, contradicting ones are errors.',
    )
    sp: int = Field(default=1, ge=1, description=SP_DESCRIPTION)


StrategyOptions = Annotated[
    DDPOptions | FSDPOptions | DeepSpeedOptions, Field(discriminator="name")
]
