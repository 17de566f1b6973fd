"""The job as the planner sees it: the memory-relevant choices flattened out of the config
once (`Setup`), resolved for the model's family (`for_model`), and the share of the model
one rank holds under tp and pp (`rank_params`). The lowest rung of the planner beside the
model's shape: memory, traffic, the device lines, history, the tiers and the plan all read
a Setup, and none of them has to import another to get one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from trainer.config import DeepSpeedOptions, FSDPOptions, JobConfig
from trainer.errors import UserError
from trainer.planner.shape import ModelShape, ShapeUnavailable


@dataclass(frozen=True)
class Setup:
    """The job's memory-relevant choices, flattened out of the config once."""

    strategy: Literal["ddp", "fsdp", "zero2", "zero3"]
    adapter: Literal["none", "lora", "qlora"] = "none"
    gpu: bool = True
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    world: int = 1
    micro_batch: int = 1
    block_size: int = 1024
    checkpointing: bool = False
    eager_attention: bool = False
    attention: str = "auto"
    """model.attn_implementation; for_model resolves auto for the model's family."""
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    merge_on_export: bool = False
    gguf_types: tuple[str, ...] = ()
    """export.gguf_types when export.formats lists gguf: each is written, then checked."""
    fsdp_reshard: bool = True
    fsdp_cpu_offload: bool = False
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    """Pipeline microbatches each micro batch is cut into (FSDP with pp > 1)."""
    sp: int = 1
    """strategy.sp: each sequence split over this many ranks (trainer.planner.sequence)."""
    grad_accum: int = 1
    offload_optimizer: str = "none"  # DeepSpeed: none | cpu | nvme
    offload_param: str = "none"
    memory_tier: bool = False
    """checkpoint.memory_every > 0: the RAM tier's keepers hold snapshots in host RAM."""
    expandable_segments: bool = True
    """scaling.expandable_segments: the allocator's slack line (trainer.planner.device)."""
    loss: str = "plain"
    """train.loss: auto | chunked | liger | plain (`chunked_loss` says which one runs)."""
    loss_chunk: int = 1024

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Setup:
        s = cfg.strategy
        kw: dict[str, Any] = {}
        name = s.name
        if isinstance(s, FSDPOptions):
            kw = {
                "fsdp_reshard": s.reshard_after_forward,
                "fsdp_cpu_offload": s.cpu_offload,
                "tp": s.tp,
                "pp": s.pp,
                "pp_schedule": s.pp_schedule,
                "microbatches": s.n_microbatches,
            }
        elif isinstance(s, DeepSpeedOptions):
            from trainer.strategies.deepspeed import config as dsconfig

            path = dsconfig.config_path(s.config)
            if not path.is_file():
                raise ShapeUnavailable(f"strategy.config {path}: not readable here")
            raw, _ = dsconfig.load(s.config)
            zero = raw.get("zero_optimization", {})
            name = f"zero{int(zero.get('stage', 0))}"
            if name not in ("zero2", "zero3"):
                raise UserError("strategy.config: zero_optimization.stage must be 2 or 3")
            kw = {
                "offload_optimizer": str(zero.get("offload_optimizer", {}).get("device", "none")),
                "offload_param": str(zero.get("offload_param", {}).get("device", "none")),
            }
        ckpt = cfg.model.gradient_checkpointing or bool(
            isinstance(s, FSDPOptions) and s.activation_checkpointing
        )
        return cls(
            strategy=name,  # type: ignore[arg-type]
            adapter=cfg.model.adapter,
            gpu=cfg.scaling.use_gpu,
            precision=cfg.train.precision,
            optimizer=cfg.optim.name,
            world=cfg.scaling.num_workers,
            # sequences: a preference pair is two (the activations of both)
            micro_batch=cfg.train.micro_batch_size * cfg.sequences_per_example,
            block_size=cfg.data.block_size,
            checkpointing=ckpt,
            eager_attention=cfg.model.attn_implementation == "eager",
            attention=cfg.model.attn_implementation,
            lora_r=cfg.model.lora.r,
            lora_targets=_targets(cfg.model.lora.target_modules),
            merge_on_export=cfg.model.lora.merge_on_export,
            gguf_types=tuple(cfg.export.gguf_types) if "gguf" in cfg.export.formats else (),
            grad_accum=cfg.train.grad_accum,
            # a number > 0; auto is decided per node type (trainer.planner.tiers)
            memory_tier=cfg.checkpoint.memory_every not in (0, "auto"),
            expandable_segments=cfg.scaling.expandable_segments,
            loss=cfg.train.loss,
            loss_chunk=cfg.train.loss_chunk,
            sp=s.sp,
            **kw,
        )

    @property
    def c(self) -> int:
        """Bytes of the compute dtype (CPU ranks always train in fp32)."""
        return 2 if self.gpu and self.precision != "fp32" else 4

    @property
    def mixed(self) -> bool:
        return self.c == 2

    @property
    def optim_bytes(self) -> int:
        """Adam state per trainable parameter: two fp32 moments, or two 8-bit ones.
        DeepSpeed builds torch AdamW (or its own CPU Adam) whatever optim.name says."""
        if self.optimizer == "adamw8bit" and self.strategy in ("ddp", "fsdp"):
            return 2
        return 8

    @property
    def offloaded(self) -> bool:
        return self.fsdp_cpu_offload or "cpu" in (self.offload_optimizer, self.offload_param)


def _targets(setting: list[str] | str) -> tuple[str, ...]:
    """model.lora.target_modules as the planner carries it: the list, or (auto,) /
    (all-linear,), resolved per family by ModelShape.lora_targets."""
    return tuple(setting) if isinstance(setting, list) else (setting,)


def for_model(s: Setup, shape: ModelShape) -> Setup:
    """The job's settings resolved for its model's family (trainer.model.families): the
    attention kernel auto picks, and the LoRA targets auto picks, as the workers will."""
    attention = shape.attention("eager" if s.eager_attention else s.attention)
    return replace(
        s,
        attention=attention,
        eager_attention=attention == "eager",
        # The modules, then a mixture of experts' fused routed experts (peft's
        # target_parameters) where auto adapts them: the plan lists and counts them too.
        lora_targets=(*shape.lora_targets(s.lora_targets), *shape.lora_fused(s.lora_targets)),
    )


def rank_params(shape: ModelShape, s: Setup) -> tuple[float, float, float]:
    """(parameters one rank's model-parallel share holds before dp sharding, of which in
    one decoder layer, of which outside the layers). TP splits the decoder matrices over
    tp; embeddings, norms and lm_head stay whole (replicated over tp). PP gives each rank
    layers / pp layers, and the worst rank one of the embedding and the LM head."""
    layer = shape.layer_params / s.tp
    root = shape.root_params if s.pp == 1 else shape.root_params / 2
    return shape.layers / s.pp * layer + root, layer, root
