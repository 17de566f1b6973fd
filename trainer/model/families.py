"""What each model family is to the trainer: which attention kernels the pinned
transformers runs it with, which modules its adapters go on, what the planner reads
from its config.json, and whether this trainer has been checked on it.

Pure (no torch, transformers or peft): preflight and the planner decide on a laptop.
The table is therefore written down here, and a unit test
(tests/unit/model/test_families.py) holds it against transformers' own
`_supports_sdpa` / `_supports_flash_attn` / `_supports_flex_attn` flags and peft's
per-architecture LoRA defaults, so a version bump that changes either fails CI instead
of drifting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError

TRANSFORMERS_PIN = "5.23.0"
PEFT_PIN = "0.21.2"

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
"""transformers 5's routed experts: one 3-D parameter per projection for all the experts
of a layer (not Linear modules, so LoRA reaches them through peft's target_parameters)."""


@dataclass(frozen=True)
class Family:
    """One `model_type` of config.json."""

    causal_lm: str
    """The class AutoModelForCausalLM builds for it."""
    sdpa: bool
    flash: bool
    flex: bool
    peft_targets: tuple[str, ...] | None
    """peft's default LoRA targets for the architecture (None: peft has none)."""
    linears: tuple[str, ...] | None = None
    """Every linear layer of a decoder layer's attention and MLP blocks; None where this
    trainer does not know the layout (its linears are then found in the loaded model)."""
    checked: bool = False
    """Trained end to end by this trainer's tests (the matrix on docs/models.md)."""
    pipeline: bool = False
    """Its causal LM is model.{embed_tokens, layers, norm, rotary_emb} + lm_head with layers
    taking position_embeddings=, as the pipeline stage builder needs."""
    why_not_sdpa: str = ""
    experts: tuple[str, ...] = ()
    """A mixture-of-experts family's fused routed-expert parameters: what `auto` gives
    peft as target_parameters beside the modules in `linears` (attention and any shared
    expert). peft's own default for these families (Mixtral's q_proj, v_proj) would train
    attention only, so `auto` does not use it for them."""


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS, True, True
    ),
    "mistral": Family(
        "MistralForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS, True, True
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS, True, True
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS, True, True
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        False,
        True,
        True,
        ("q_proj", "v_proj"),
        LLAMA_LINEARS,
        True,
        why_not_sdpa="its attention-logit soft-capping runs in the eager, flash and flex "
        "kernels only",
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS, True
    ),
    "phi3": Family("Phi3ForCausalLM", True, True, True, None, PHI3_LINEARS, True, True),
    # Known to transformers and peft, not yet trained end to end here: a preflight warning.
    "gemma": Family("GemmaForCausalLM", True, True, True, ("q_proj", "v_proj"), LLAMA_LINEARS),
    "mixtral": Family(
        "MixtralForCausalLM",
        True,
        True,
        True,
        ("q_proj", "v_proj"),
        ATTENTION_LINEARS,
        experts=FUSED_EXPERTS,
    ),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM",
        True,
        True,
        True,
        None,
        (*ATTENTION_LINEARS, "gate_proj", "up_proj", "down_proj"),  # + the shared expert's
        experts=FUSED_EXPERTS,
    ),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", True, True, True, None, ATTENTION_LINEARS, experts=FUSED_EXPERTS
    ),
    "phi": Family("PhiForCausalLM", True, True, True, ("q_proj", "v_proj", "fc1", "fc2")),
    "starcoder2": Family("Starcoder2ForCausalLM", True, True, True, None),
    "olmo2": Family("Olmo2ForCausalLM", True, True, True, None),
    "granite": Family("GraniteForCausalLM", True, True, True, None),
    "cohere": Family("CohereForCausalLM", True, True, True, None),
    "smollm3": Family("SmolLM3ForCausalLM", True, True, True, None),
    "gpt_oss": Family(
        "GptOssForCausalLM",
        False,
        True,
        True,
        None,
        ATTENTION_LINEARS,
        why_not_sdpa="its attention sinks run in the eager, flash and flex kernels only",
        experts=FUSED_EXPERTS,
    ),
    "falcon": Family("FalconForCausalLM", True, True, False, ("query_key_value",)),
    "gpt_neox": Family("GPTNeoXForCausalLM", True, True, True, ("query_key_value",)),
    "gpt2": Family("GPT2LMHeadModel", True, True, False, ("c_attn",)),
}
"""model_type → what transformers 5.23.0 and peft 0.21.2 say about it."""

ATTENTION_CHOICES = ("auto", "sdpa", "eager")
"""What model.attn_implementation accepts. flash_attention_2 and flex_attention are not
offered: the images carry no flash-attn package, and flex attention compiles its kernel
(the images ship no C compiler for CPU nodes); sdpa already uses PyTorch's flash kernel
on GPUs that have one."""


def model_type(mconf: dict[str, Any]) -> str:
    """config.json's model_type (a multimodal wrapper's text model where that is what
    trains: Gemma 3's text_config)."""
    return str(mconf.get("model_type", ""))


def family(mconf: dict[str, Any]) -> Family | None:
    return FAMILIES.get(model_type(mconf))


def resolve_attention(requested: str, mconf: dict[str, Any], where: str = "config.json") -> str:
    """The attention kernel a job runs: `auto` is sdpa where the model supports it, else
    eager (both take the document mask: trainer.data.packing). An explicit choice the
    model cannot run is refused here, in one line, before any worker starts."""
    fam = family(mconf)
    if requested == "auto":
        return "sdpa" if fam is None or fam.sdpa else "eager"
    if requested == "sdpa" and fam is not None and not fam.sdpa:
        raise ConfigError(
            f"model.attn_implementation sdpa: {fam.causal_lm} ({where}) cannot run with sdpa "
            f"in transformers {TRANSFORMERS_PIN} ({fam.why_not_sdpa}); set "
            "model.attn_implementation: auto (or eager)"
        )
    return requested


def all_linear(mconf: dict[str, Any]) -> tuple[str, ...] | None:
    fam = family(mconf)
    return fam.linears if fam is not None else None


def resolve_targets(setting: Any, mconf: dict[str, Any]) -> tuple[str, ...] | None:
    """The LoRA target modules: an explicit list as given; `auto` is peft's default for
    the architecture where it has one, else every linear of the attention and MLP blocks
    (`all-linear`). None: the family's layout is not in the table, and the loaded model's
    own linears are used (trainer.model.adapters)."""
    if isinstance(setting, list | tuple):
        return tuple(setting)
    fam = family(mconf)
    if setting == "auto" and fam is not None and fam.peft_targets is not None and not fam.experts:
        return fam.peft_targets
    return all_linear(mconf)


def resolve_parameters(setting: Any, mconf: dict[str, Any]) -> tuple[str, ...]:
    """The LoRA target parameters (peft's `target_parameters`): under `auto` (and
    `all-linear`) a mixture-of-experts family's fused routed experts, so an adapter on
    such a model trains its experts and not only its attention; none for an explicit
    module list or a dense family."""
    fam = family(mconf)
    if isinstance(setting, list | tuple) or fam is None:
        return ()
    return fam.experts


def describe_targets(setting: Any, mconf: dict[str, Any]) -> str:
    targets = resolve_targets(setting, mconf)
    text = ", ".join(targets) if targets else "every linear of the attention and MLP blocks"
    params = resolve_parameters(setting, mconf)
    return f"{text}; routed experts {', '.join(params)}" if params else text


def qlora_refusal(adapter: str, mconf: dict[str, Any], where: str) -> None:
    """QLoRA is refused on a mixture of experts, in one line, before anything loads: its
    routed experts are fused 3-D parameters (transformers 5), and both 4-bit formats here
    (bitsandbytes' Linear4bit for DDP, torchao's NF4 in trainer.model.nf4 for FSDP2) only
    replace Linear layers, while peft's target_parameters adapts a plain parameter. The
    experts (~90 % of Qwen3-30B-A3B) would silently stay in 16 bits under a "4-bit" run."""
    routed = int(mconf.get("num_experts") or mconf.get("num_local_experts") or 0)
    if adapter != "qlora" or not (routed or resolve_parameters("auto", mconf)):
        return
    raise ConfigError(
        f"model.adapter qlora: model_type {model_type(mconf) or '(none)'} ({where}) is a "
        "mixture of experts whose routed experts are fused 3-D parameters, which neither "
        "bitsandbytes' nor torchao's 4-bit format (Linear layers only) quantizes; use "
        "model.adapter lora (its plan counts the experts in 16 bits)"
    )


def check(
    *,
    mconf: dict[str, Any],
    where: str,
    attention: str,
    adapter: str,
    targets: Any,
    pp: int,
) -> list[str]:
    """Preflight for the model's family: refuses what is known to fail (an attention
    kernel the model lacks, pipeline stages for a family the stage builder does not know)
    and returns one-line warnings for a family this trainer has not been checked on."""
    resolve_attention(attention, mconf, where)
    fam = family(mconf)
    mt = model_type(mconf) or "(none)"
    if pp > 1 and (fam is None or not fam.pipeline):
        allowed = ", ".join(k for k, f in FAMILIES.items() if f.pipeline)
        raise ConfigError(
            f"strategy.pp: model_type {mt} ({where}) is not a family the pipeline stage "
            f"builder knows ({allowed}); set strategy.pp: 1"
        )
    qlora_refusal(adapter, mconf, where)
    notes = []
    if fam is None or not fam.checked:
        checked = ", ".join(k for k, f in FAMILIES.items() if f.checked)
        notes.append(
            f"model.path: model_type {mt} ({where}) has not been checked with this trainer "
            f"(checked: {checked}); it may train, but watch the first steps"
        )
    if adapter != "none" and targets == "auto" and resolve_targets(targets, mconf) is None:
        notes.append(
            f"model.lora.target_modules auto: model_type {mt} has no known layout; adapters "
            "go on every linear of its decoder layers (the planner assumes Llama's)"
        )
    return notes
