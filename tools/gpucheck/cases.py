"""gpu-check's cases: which strategies it trains, the model sizes, the job each case
submits, and what the planner predicts for it. Pure (no torch, no processes): the driver,
the MFU case and the report read these, and nothing here reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

FIT = 0.80
"""A strategy's model is shrunk (layers halved) until the planner predicts at most this
share of the GPU's memory."""

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": {"name": "ddp"}},
    "fsdp": {"strategy": {"name": "fsdp"}},
    "fsdp_ac": {"strategy": {"name": "fsdp", "activation_checkpointing": True}},
    # MFU where it means something: Raylift's step on a Llama-3-8B shape, as many layers
    # as fit (tools/gpucheck/mfu.py; no checkpoint or export). Before ZeRO-3, as above.
    "mfu_8b": {"strategy": {"name": "fsdp"}},
    # Adapters sharded: the frozen base split over the ranks (torchao NF4 under FSDP2).
    # Before ZeRO-3 runs: on CPU every job shares one process, and ZeRO-3's partitioned
    # init leaves torch's F.linear patched for the rest of it.
    "fsdp_lora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "lora"}},
    "fsdp_qlora": {"strategy": {"name": "fsdp"}, "model": {"adapter": "qlora"}},
    "zero2": {"strategy": {"name": "deepspeed", "config": "zero2"}},
    "zero3": {"strategy": {"name": "deepspeed", "config": "zero3"}},
    "zero3_offload": {"strategy": {"name": "deepspeed", "config": "zero3_offload"}},
    "lora": {"strategy": {"name": "ddp"}, "model": {"adapter": "lora"}},
    "qlora": {
        "strategy": {"name": "ddp"},
        "model": {"adapter": "qlora"},
        "optim": {"name": "adamw8bit"},
    },
    "zero3_lora": {
        "strategy": {"name": "deepspeed", "config": "zero3"},
        "model": {"adapter": "lora"},
    },
}


def has_adapter(name: str) -> bool:
    return STRATEGIES[name].get("model", {}).get("adapter", "none") != "none"


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    block: int
    micro: int
    steps: int
    lr: float
    adapter_lr: float
    """Adapters train few weights and take a larger rate; 1e-2 diverged in bf16 on the
    0.3B GPU model (loss 6.8 -> 4.3 -> 18 in six steps on an H200) and 1e-3 fell to 3.2."""
    ffn: int = 0
    """The MLP's width (0: twice the hidden size)."""
    kv_heads: int = 0
    """Key/value heads (0: half the heads)."""
    vocab: int = 0
    """The model's vocabulary, at least the tokenizer's (0: the tokenizer's)."""

    @property
    def intermediate(self) -> int:
        return self.ffn or 2 * self.hidden


GPU_SIZE = Size(
    hidden=2048, layers=16, heads=16, block=512, micro=4, steps=10, lr=3e-4, adapter_lr=1e-3
)
"""About 0.6B parameters: 16 layers of 2048 wide (GQA, 8 KV heads, MLP 4096 wide)."""
CPU_SIZE = Size(hidden=64, layers=2, heads=4, block=32, micro=2, steps=4, lr=3e-3, adapter_lr=1e-2)


def llama_config(size: Size, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": max(vocab, size.vocab),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads or max(1, size.heads // 2),
        "max_position_embeddings": max(256, size.block),
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def job_dict(
    name: str, size: Size, world: int, gpu: bool, assets: dict[str, str], storage: str
) -> dict[str, Any]:
    case = STRATEGIES[name]
    half = max(1, size.steps // 2)
    lr = size.adapter_lr if has_adapter(name) else size.lr
    return {
        "model": {
            "path": assets["model"],
            "special_tokens": assets["tokens"],
            **case.get("model", {}),
        },
        "data": {"train_file": assets["train"], "block_size": size.block},
        "strategy": case["strategy"],
        "train": {
            "micro_batch_size": size.micro,
            "max_steps": size.steps,
            "precision": "bf16" if gpu else "fp32",
            "log_every": 1,
            "seed": 7,
        },
        "optim": {"lr": lr, "schedule": "constant", **case.get("optim", {})},
        "scaling": {"num_workers": world, "use_gpu": gpu},
        "checkpoint": {"every_steps": half, "keep_last": 2},
        "storage": {"path": storage},
        "run": {"name": f"gpucheck-{name}"},
    }


def fitted_size(name: str, size: Size, world: int, gpu_bytes: float | None) -> Size:
    """Halve the layers until the planner predicts this strategy fits FIT of the GPU."""
    if gpu_bytes is None:
        return size
    while size.layers > 1 and predicted(name, size, world) > FIT * gpu_bytes:
        size = replace(size, layers=size.layers // 2)
    return size


def _cfg(name: str, size: Size, world: int, gpu: bool, assets: dict[str, str], storage: str):
    from trainer.config import load_config

    return load_config(job_dict(name, size, world, gpu, assets, storage))


def plan_memory(cfg: Any, shape: Any) -> tuple[Any, Any]:
    from trainer.planner.memory import Setup, rank_memory

    setup = Setup.from_config(cfg)
    return setup, rank_memory(shape, setup)


def predicted(name: str, size: Size, world: int, vocab: int = 520) -> float:
    """Predicted peak GPU bytes per rank, without the CUDA context and library workspaces
    (which `max_memory_reserved` does not see either)."""
    from trainer.planner.shape import ModelShape

    fake = {"model": "/nonexistent", "train": "/nonexistent.jsonl", "tokens": "/nonexistent"}
    cfg = _cfg(name, size, world, True, fake, "/tmp")
    _, mem = plan_memory(cfg, ModelShape.from_hf_config(llama_config(size, vocab)))
    return mem.total - mem.overhead
