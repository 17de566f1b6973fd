"""The adapter axis: LoRA and QLoRA (peft + bitsandbytes), composable with a strategy.

`model.adapter: none` trains every weight. `lora` freezes the base (loaded in the compute
dtype: it is never updated, so no fp32 master copy is needed) and trains low-rank
adapters; `qlora` does the same over a 4-bit nf4 base with double quantization. When the
job adds special tokens the new embedding rows must be learned, so the input and output
embeddings are trained in full too (`modules_to_save`); the adapter folder then holds them.

Every strategy builds the same adapter: lora_A's initial values come from a generator
seeded by the job's seed and the parameter's name (never the global RNG), so DDP, FSDP2
(which builds the adapters on the meta device and does not broadcast) and ZeRO-3 start
from identical weights. The 4-bit format depends on the strategy: DDP's QLoRA base is
bitsandbytes' nf4; FSDP2's is torchao's NF4 (trainer.model.nf4), which shards.
"""

from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.model.loading import DTYPES, load_model

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
MERGED_DIR = "model_merged"


def enabled(cfg: JobConfig) -> bool:
    return cfg.model.adapter != "none"


def base_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    """The frozen base's dtype: the compute dtype on GPUs, fp32 on CPUs (no bf16 kernels
    worth having there, and fp32 keeps CPU runs comparable with full fine-tuning)."""
    if device.type != "cuda":
        return torch.float32
    return DTYPES[cfg.train.precision]


def quantization(cfg: JobConfig, device: torch.device) -> Any:
    if cfg.model.adapter != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(
            "model.adapter qlora: bitsandbytes is not installed (use the bnb image)"
        ) from None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=base_dtype(cfg, device),
    )


def keep_4bit_layout(model: torch.nn.Module) -> int:
    """bitsandbytes 0.50.2's Linear4bit.forward, on CPUs with avx512_bf16, rewrites its
    weight in place into a CPU-packed layout the first time it runs in eval mode on an
    input that needs no grad. That changes later training losses (and desynchronises
    FSDP shards). The switch is an internal attribute, which is why bitsandbytes is
    pinned; returns how many layers were switched off."""
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def apply(model: Any, cfg: JobConfig, grew_vocab: bool, kbit: bool | None = None) -> Any:
    """Wrap the loaded base in a PEFT model with the configured adapters. `kbit`: prepare
    a bitsandbytes 4-bit base (DDP's QLoRA; by default when the adapter is qlora). The
    adapters get their deterministic initial values unless the model is a meta skeleton
    (FSDP2 loads them with the base: `initial_value`)."""
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError:
        raise UserError(
            f"model.adapter {cfg.model.adapter}: peft is not installed (use the trainer image)"
        ) from None
    if kbit is None:
        kbit = cfg.model.adapter == "qlora"
    from trainer.model import families

    families.qlora_refusal(cfg.model.adapter, model.config.to_dict(), cfg.model.path)
    if kbit:
        keep_4bit_layout(model)
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.model.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    lo = cfg.model.lora
    targets = target_modules(model, lo.target_modules)
    params = target_parameters(model, lo.target_modules)
    peft_cfg = LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=targets,
        target_parameters=list(params) or None,
        modules_to_save=embedding_names(model) if grew_vocab else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_cfg)
    if cfg.model.gradient_checkpointing and not kbit:
        model.enable_input_require_grads()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_weight(name) and p.device.type != "meta":
                p.copy_(initial_value(name, tuple(p.shape), cfg.train.seed).to(p.dtype))
    kinds = trainable_by_kind(model)
    log.info(
        "LoRA trains %s parameters: %s",
        f"{sum(kinds.values()):,}",
        ", ".join(f"{k} {v:,}" for k, v in kinds.items()),
    )
    return model


KINDS = ("attention", "experts", "shared", "router", "mlp", "embeddings", "other")


def kind_of(name: str) -> str:
    """Which part of a decoder a parameter (or its adapter) belongs to, by its name:
    a mixture-of-experts model's routed experts, shared expert and router apart from its
    attention, so a log line shows an adapter that misses the experts."""
    if ".experts." in name or name.endswith(".experts"):
        return "experts"
    if ".shared_expert" in name:
        return "shared"
    if ".mlp.gate." in name or ".router." in name:
        return "router"
    if "attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "embed" in name or "lm_head" in name:
        return "embeddings"
    return "other"


def trainable_by_kind(model: torch.nn.Module) -> dict[str, int]:
    """Trainable parameter counts per kind (`kind_of`), kinds with none left out."""
    out = dict.fromkeys(KINDS, 0)
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[kind_of(name)] += getattr(p, "ds_numel", None) or p.numel()
    return {k: v for k, v in out.items() if v}


def block_linears(model: Any) -> list[str]:
    """The short names of every linear layer inside the decoder layers (the attention and
    MLP blocks; not the embeddings or lm_head), in the model's order."""
    out: list[str] = []
    for name, m in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if ".layers." in name and type(m).__name__.startswith("Linear") and short not in out:
            out.append(short)
    return out


def target_modules(model: Any, setting: Any) -> list[str]:
    """The modules that get adapters: model.lora.target_modules resolved for this model's
    family (trainer.model.families: peft's default, else every linear of the attention
    and MLP blocks), or the explicit list, checked against the model's modules."""
    from trainer.model import families

    conf = model.config.to_dict()
    targets = families.resolve_targets(setting, conf)
    if targets is None:
        targets = tuple(block_linears(model))
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise UserError(
            f"model.lora.target_modules: {missing} are not modules of this model "
            f"(it has e.g. {sorted(n for n in names if n.endswith('proj'))[:8]}); "
            "model.lora.target_modules: auto picks this family's"
        )
    return list(targets)


def target_parameters(model: Any, setting: Any) -> tuple[str, ...]:
    """The fused parameters that get adapters (peft's target_parameters): a
    mixture-of-experts family's routed experts under `auto` (trainer.model.families),
    checked against the model's parameters so a renamed layout fails here and not as an
    adapter that silently trains attention only."""
    from trainer.model import families

    params = families.resolve_parameters(setting, model.config.to_dict())
    names = [n for n, _ in model.named_parameters()]
    missing = [t for t in params if not any(n.endswith("." + t) for n in names)]
    if missing:
        raise UserError(
            f"model.lora.target_modules {setting}: this {type(model).__name__} has no "
            f"parameters {missing} (its routed experts in transformers "
            f"{families.TRANSFORMERS_PIN}); list its modules in model.lora.target_modules"
        )
    return params


def one_trainable_dtype(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every trainable tensor that is still a plain tensor one dtype, and return how
    many changed. DeepSpeed in bf16 keeps its own fp32 master copy and wants its trainable
    partitions in one low-precision dtype, but peft upcasts new adapters to fp32 over a
    bf16 base while its copies of grown embeddings stay bf16: ZeRO-3 then stops in an
    assertion (seen on an H200). ZeRO-3's partitioned parameters (`ds_id`) already have
    the engine's dtype and are left alone."""
    changed = 0
    for p in model.parameters():
        plain = not hasattr(p, "ds_id")
        if plain and p.requires_grad and p.dtype.is_floating_point and p.dtype != dtype:
            p.data = p.data.to(dtype)
            changed += 1
    kinds = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(kinds) > 1:
        raise UserError(
            f"model.adapter {sorted(map(str, kinds))}: the trainable tensors have more than "
            "one dtype after casting to the compute dtype; DeepSpeed needs one"
        )
    return changed


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """An adapter weight's initial value, the same in every strategy and on every rank:
    peft's own init (kaiming-uniform A, zero B) from a generator seeded by the job's seed
    and the weight's name."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)
    return out


_PEFT_PARTS = (".base_layer", ".original_module", ".modules_to_save.default")


def base_name(peft_name: str) -> str:
    """The Hugging Face checkpoint's name for a PEFT model's frozen or copied weight
    (`base_model.model.x.q_proj.base_layer.weight` → `x.q_proj.weight`)."""
    name = peft_name.removeprefix("base_model.model.")
    for part in _PEFT_PARTS:
        name = name.replace(part, "")
    return name


def full_weights(
    names: list[str], shapes: dict[str, tuple[int, ...]], weights: dict[str, Any], seed: int
) -> dict[str, Any]:
    """A PEFT model's full state (by its names) from the base checkpoint's weights and the
    adapters' initial values; what FSDP2 loads into its sharded skeleton."""
    out: dict[str, Any] = {}
    for name in names:
        if is_adapter_weight(name):
            out[name] = initial_value(name, shapes[name], seed)
        elif base_name(name) in weights:
            out[name] = weights[base_name(name)]
    return out


def grew_vocab(model_dir: Path, vocab_size: int) -> bool:
    """Whether the job's special tokens grow the vocabulary (their rows then train)."""
    from trainer.model import hfconfig

    return vocab_size > int(hfconfig.read_local(model_dir)["vocab_size"])


def embedding_names(model: Any) -> list[str]:
    """The short names of the input and output embedding modules (embed_tokens, lm_head)."""
    out = []
    for getter in (model.get_input_embeddings, model.get_output_embeddings):
        module = getter()
        for name, m in model.named_modules():
            if m is module:
                out.append(name.rsplit(".", 1)[-1])
                break
    return out


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != want:
        missing, unexpected = sorted(want - set(state))[:3], sorted(set(state) - want)[:3]
        raise UserError(
            f"{where}: the checkpoint's trainable weights do not match this job's adapter "
            f"(missing {missing}, unexpected {unexpected}); "
            "keep model.adapter and model.lora equal to resume, or use a new run.name"
        )
    with torch.no_grad():
        params = dict(model.named_parameters())
        for n, t in state.items():
            params[n].copy_(t)


def export(
    model: Any,
    out: Path,
    tokenizer: Any,
    cfg: JobConfig,
    source_dir: Path,
    state_dict: dict[str, Any] | None = None,
) -> None:
    """`out/adapter/`: a PEFT adapter folder (+ tokenizer). With lora.merge_on_export,
    also `out/model_merged/`: the full-precision base with the adapter merged in, built
    from a fresh copy of the base so training is not disturbed. A sharded strategy hands
    in the trainable weights it gathered (`state_dict`, PEFT names)."""
    adapter_dir = out / ADAPTER_DIR
    if state_dict is None:
        model.save_pretrained(str(adapter_dir))
    else:
        model.save_pretrained(str(adapter_dir), state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(adapter_dir))
    if not cfg.model.lora.merge_on_export:
        return
    from peft import PeftModel

    base = load_model(source_dir, cfg, len(tokenizer), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out / MERGED_DIR), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out / MERGED_DIR))
