"""The planner's stated constants and the model's shape (layers, widths, parameters), read
from a model folder's config.json or a reference size.

Sizes are bytes unless a name says otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.model import hfconfig

GIB = 1024**3

# ---------------------------------------------------------------- stated constants
CPU_RANK_OVERHEAD = 1.0 * GIB
"""Per CPU rank: the Python process with torch, transformers and a Ray worker loaded."""
HOST_PER_GPU_PROCESS = 3.0 * GIB
"""Host RAM of one GPU worker process (CUDA user-space libraries, torch, Ray worker)."""
HOST_NODE_RESERVE = 4.0 * GIB
"""Host RAM per node for the OS, raylet, the object store's working set and page cache."""
TIGHT = 0.90
"""A need above 90% of a capacity is 'tight'; above 100% it 'does not fit'."""
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
"""nf4 (4 bits) + double-quantized absmax: an 8-bit constant per 64-weight block and an
fp32 constant per 256 such blocks (QLoRA paper, sec. 3: 0.127 bits/param)."""
DEFAULT_MFU = 0.35
OFFLOAD_MFU = 0.15
"""Assumed model-FLOPs utilisation. 0.15 with CPU offload is what the Ray Llama-2 template's
reference run gets: 7B, ZeRO-3 + offload, 16×A10G, 3.5M tokens in ~14 min."""

Verdict = Literal["fits", "tight", "does not fit"]


class ShapeUnavailable(UserError):
    """An input the plan needs (the model's config.json, a DeepSpeed JSON) cannot be read
    from here; submit then skips the plan instead of refusing."""


_ORDER: dict[str, int] = {"fits": 0, "tight": 1, "does not fit": 2}


# ---------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama/Mistral/Qwen-style decoder that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    params_override: int | None = None
    """An explicit parameter count (the shape is then only used for activations)."""
    model_type: str = ""
    """config.json's model_type: the family's layout (trainer.model.families)."""
    norms: int = 2
    """RMSNorms per decoder layer (Gemma 2 and 3: four, around attention and MLP)."""
    qk_norm: bool = False
    """Per-head RMSNorms on queries and keys (Qwen3, Gemma 3)."""
    logit_softcap: float | None = None
    """Final logit soft-capping (Gemma 2 and 3): a tanh over the logits, kept for backward."""
    attn_softcap: float | None = None
    """Attention-logit soft-capping (Gemma 2): a tanh over the scores in eager attention."""
    sliding_window: int | None = None
    """The sliding window of the layers that have one (memory does not depend on it with
    sdpa and eager, which build the full score matrix either way)."""
    experts: int = 0
    """Routed experts per layer of a mixture-of-experts model (0: a dense MLP)."""
    experts_per_tok: int = 0
    """Experts each token is routed to: the active part FLOPs are counted on."""
    expert_intermediate: int = 0
    """One expert's intermediate width (moe_intermediate_size; Mixtral's intermediate_size)."""
    shared_intermediate: int = 0
    """A shared expert's intermediate width (Qwen2-MoE), 0 without one."""

    @classmethod
    def from_hf_config(cls, conf: dict[str, Any], where: str = "config.json") -> ModelShape:
        text = conf.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in conf:
            conf = text
        try:
            heads = int(conf["num_attention_heads"])
            model_type = str(conf.get("model_type", ""))
            gemma = model_type.startswith("gemma2") or model_type.startswith("gemma3")
            return cls(
                hidden=int(conf["hidden_size"]),
                layers=int(conf["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(conf.get("num_key_value_heads") or heads),
                intermediate=int(conf["intermediate_size"]),
                vocab=int(conf["vocab_size"]),
                tied=bool(conf.get("tie_word_embeddings", False)),
                head_dim=int(conf["head_dim"]) if conf.get("head_dim") else None,
                # Qwen2 always has q/k/v biases; Llama/Mistral say so in attention_bias.
                qkv_bias=bool(conf.get("attention_bias", model_type.startswith("qwen2"))),
                o_bias=bool(conf.get("attention_bias", False)),
                mlp_bias=bool(conf.get("mlp_bias", False)),
                model_type=model_type,
                norms=4 if gemma else 2,
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"),
                logit_softcap=_number(conf.get("final_logit_softcapping")),
                attn_softcap=_number(conf.get("attn_logit_softcapping")),
                sliding_window=_window(conf),
                **_experts(conf),
            )
        except KeyError as exc:
            raise UserError(
                f"{where}: no {exc.args[0]}; the planner reads Llama/Mistral/Qwen-style "
                "configs (pass a parameter count with --params for others)"
            ) from None

    @classmethod
    def from_params(cls, params: int) -> ModelShape:
        """A Llama-2-family shape for a bare parameter count: the published shape nearest
        in size, carrying the given count. Activations then follow that shape."""
        best = min(_REFERENCE_SHAPES, key=lambda s: abs(math.log(s.params / params)))
        return ModelShape(**{**asdict(best), "params_override": int(params)})

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear in one decoder layer, by its module name (Phi-3 fuses
        q/k/v into qkv_proj and gate/up into gate_up_proj)."""
        h, i = self.hidden, self.intermediate
        if self.experts:  # attention, and the shared expert's MLP where there is one
            out = {
                "q_proj": (h, self.q_dim),
                "k_proj": (h, self.kv_dim),
                "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h),
            }
            if self.shared_intermediate:
                si = self.shared_intermediate
                out.update(gate_proj=(h, si), up_proj=(h, si), down_proj=(si, h))
            return out
        if self.model_type == "phi3":
            return {
                "qkv_proj": (h, self.q_dim + 2 * self.kv_dim),
                "o_proj": (self.q_dim, h),
                "gate_up_proj": (h, 2 * i),
                "down_proj": (i, h),
            }
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """(experts, out, in) of each fused routed-expert parameter in one layer."""
        if not self.experts:
            return {}
        h, e, ei = self.hidden, self.experts, self.expert_intermediate
        return {"experts.gate_up_proj": (e, 2 * ei, h), "experts.down_proj": (e, h, ei)}

    @property
    def router_params(self) -> int:
        """A layer's router (and shared-expert gate): hidden → experts (→ 1)."""
        return self.hidden * (self.experts + (1 if self.shared_intermediate else 0))

    @property
    def layer_linear_params(self) -> int:
        """Every matrix of a layer, all routed experts included (memory holds them all)."""
        experts = sum(math.prod(s) for s in self.expert_shapes().values())
        linears = sum(a * b for a, b in self.linear_shapes().values())
        return linears + experts + (self.router_params if self.experts else 0)

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden * self.o_bias
        bias += (2 * self.intermediate + self.hidden) * self.mlp_bias
        norms = self.norms * self.hidden + 2 * self.hd * self.qk_norm
        return self.layer_linear_params + bias + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Exact for these decoders: embeddings + L layers + final norm + lm_head."""
        if self.params_override is not None:
            return self.params_override
        head = 0 if self.tied else self.embedding_params
        return self.embedding_params + self.layers * self.layer_params + self.hidden + head

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: all of a dense model's; a mixture of
        experts' less the routed experts it is not sent to. FLOPs and MFU count these;
        memory counts `params`."""
        if not self.experts or self.params_override is not None:
            return self.params
        idle = (self.experts - self.experts_per_tok) / self.experts
        routed = sum(math.prod(s) for s in self.expert_shapes().values())
        return self.params - round(self.layers * routed * idle)

    @property
    def root_params(self) -> int:
        """What is not in a decoder layer: embeddings, final norm, lm_head."""
        return max(self.params - self.layers * self.layer_params, 0)

    def lora_targets(self, setting: Any) -> tuple[str, ...]:
        """model.lora.target_modules for this model's family (auto, all-linear or a list),
        as trainer.model.adapters resolves it; a family without a known layout is planned
        with its linears named as Llama's."""
        from trainer.model import families

        if isinstance(setting, list | tuple) and len(setting) == 1:
            setting = setting[0] if setting[0] in ("auto", "all-linear") else list(setting)
        conf = {"model_type": self.model_type}
        return families.resolve_targets(setting, conf) or tuple(self.linear_shapes())

    def lora_params(self, r: int, targets: Any) -> int:
        return sum(n for n, _ in self.lora_by_kind(r, targets).values())

    def lora_fused(self, setting: Any) -> tuple[str, ...]:
        """The fused routed-expert parameters LoRA adapts (peft's target_parameters):
        auto's for a mixture-of-experts family, or those a resolved target list names."""
        from trainer.model import families

        if isinstance(setting, list | tuple) and len(setting) == 1:
            setting = setting[0] if setting[0] in ("auto", "all-linear") else list(setting)
        fused = families.resolve_parameters(setting, {"model_type": self.model_type})
        named = (
            tuple(t for t in setting if t in self.expert_shapes())
            if isinstance(setting, list | tuple)
            else ()
        )
        return tuple(dict.fromkeys((*fused, *named)))

    def lora_by_kind(self, r: int, targets: Any) -> dict[str, tuple[int, tuple[str, ...]]]:
        """LoRA's trainable parameters per part of the decoder, the kinds the run's log
        prints (trainer.model.adapters.kind_of): attention, routed experts, shared expert,
        a dense MLP; each with the tensors adapted. An adapter that misses a mixture of
        experts' routed experts shows as a plan without an `experts` row."""
        setting = targets
        targets = self.lora_targets(targets)
        out: dict[str, tuple[int, tuple[str, ...]]] = {}

        def add(kind: str, n: int, name: str) -> None:
            count, names = out.get(kind, (0, ()))
            out[kind] = (count + self.layers * n, (*names, name))

        for name, (a, b) in self.linear_shapes().items():
            if name in targets:
                attention = name in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
                add(
                    "attention" if attention else "shared" if self.experts else "mlp",
                    r * (a + b),
                    name,
                )
        fused = self.lora_fused(setting)
        # peft's adapter on a fused (experts, out, in) parameter: A (r·experts × in) and
        # B (out × r·experts).
        for t, (e, o, i) in self.expert_shapes().items():
            if t in fused:
                add("experts", r * e * (o + i), t)
        return out

    def attention(self, requested: str) -> str:
        """model.attn_implementation resolved for this family (trainer.model.families)."""
        from trainer.model import families

        return families.resolve_attention(requested, {"model_type": self.model_type})


LLAMA2_7B_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}
"""Llama-2-7B's config.json: the docs' example jobs (tools/docgen/planfigures.py,
tools/cadencefigures.py) and the planner tests' reference shape."""

_REFERENCE_SHAPES = (
    ModelShape(2048, 22, 32, 4, 5632, 32000),  # TinyLlama-1.1B
    ModelShape(4096, 32, 32, 32, 11008, 32000),  # Llama-2-7B
    ModelShape(5120, 40, 40, 40, 13824, 32000),  # Llama-2-13B
    ModelShape(8192, 80, 64, 8, 28672, 32000),  # Llama-2-70B
)


def shape_for_job(cfg: JobConfig, read_text: Any = None) -> ModelShape:
    """The model's shape from its config.json (a local folder, or through `read_text` for
    s3://), with the vocabulary grown by the job's special tokens when they are readable."""
    src = hfconfig.config_uri(cfg.model.path)
    if cfg.model.path.startswith("s3://"):
        if read_text is None:
            raise ShapeUnavailable(f"{src}: not readable here; pass --params to plan without it")
        text = read_text(src)
    else:
        path = Path(src).expanduser()
        if not path.is_file():
            raise ShapeUnavailable(f"{path}: not found; pass --params to plan without it")
        text = path.read_text()
    shape = ModelShape.from_hf_config(hfconfig.parse(text, src), src)
    extra = _special_token_count(cfg.model.special_tokens)
    if extra:
        # An upper bound: tokens the tokenizer already has do not grow the vocabulary.
        shape = ModelShape(**{**asdict(shape), "vocab": shape.vocab + extra})
    return shape


def _experts(conf: dict[str, Any]) -> dict[str, int]:
    """A mixture-of-experts config's expert fields (Qwen2/3-MoE's num_experts and
    moe_intermediate_size, Mixtral's num_local_experts and intermediate_size, gpt-oss's
    num_local_experts); none for a dense model."""
    experts = int(conf.get("num_experts") or conf.get("num_local_experts") or 0)
    if not experts:
        return {}
    return {
        "experts": experts,
        "experts_per_tok": int(conf.get("num_experts_per_tok") or experts),
        "expert_intermediate": int(conf.get("moe_intermediate_size") or conf["intermediate_size"]),
        "shared_intermediate": int(conf.get("shared_expert_intermediate_size") or 0),
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value else None


def _window(conf: dict[str, Any]) -> int | None:
    if conf.get("use_sliding_window") is False:  # Qwen2/3 keep the number, switched off
        return None
    window = conf.get("sliding_window")
    return int(window) if isinstance(window, int) and window > 0 else None


def _special_token_count(path: str | None) -> int:
    if not path or "://" in path or not Path(path).expanduser().is_file():
        return 0
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    tokens = data.get("tokens", []) if isinstance(data, dict) else data
    return len(tokens) if isinstance(tokens, list) else 0


def short_count(n: int) -> str:
    """A parameter count as people say it: 6.74B, 107.0M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
