"""What a (dp, pp, tp) layout asks of the model, checked from its config.json before any
worker starts (pure Python: the laptop's preflight runs it)."""

from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError


def check_model_layout(strategy: Any, mcfg: dict[str, Any], src: str) -> None:
    """Refuse, in one line each, a layout the model cannot be cut into. `strategy` is the
    job's FSDPOptions; `mcfg` the model's config.json as a dict."""
    tp, pp = getattr(strategy, "tp", 1), getattr(strategy, "pp", 1)
    sp = getattr(strategy, "sp", 1)
    if sp > 1:
        check_sequence_heads(sp, mcfg, src)
    if tp > 1:
        _check_heads("tp", "tensor parallelism", tp, mcfg, src, kv_first=False)
        inter = mcfg.get("intermediate_size")
        if isinstance(inter, int) and inter % tp:
            raise ConfigError(
                f"strategy.tp: {tp} does not divide the model's intermediate_size {inter} "
                f"({src}); use a divisor of it"
            )
    if pp > 1:
        layers = mcfg.get("num_hidden_layers")
        stages = pp * strategy.stages_per_rank
        if not isinstance(layers, int):
            raise ConfigError(f"strategy.pp: {src} has no num_hidden_layers to cut into stages")
        if layers % stages:
            raise ConfigError(
                f"strategy.pp: the model's {layers} layers do not split into {stages} equal "
                f"stages (pp {pp} × {strategy.stages_per_rank} per worker for "
                f"{strategy.pp_schedule}) ({src}); pick pp so that stages divide {layers}"
            )
        if mcfg.get("tie_word_embeddings", False):
            raise ConfigError(
                f"strategy.pp: the model ties its input and output embeddings ({src}), which "
                "live on the first and last stage; pipeline parallelism refuses tied "
                "embeddings in this build (use tp or plain fsdp)"
            )


def check_sequence_heads(sp: int, mcfg: dict[str, Any], src: str) -> None:
    """Ulysses hands each of the sp workers whole heads (and their KV heads) of the whole
    sequence, so sp must divide both; a mixture-of-experts router's aux loss would see
    only a worker's share of the tokens, so those models are refused for now."""
    _check_heads("sp", "sequence parallelism", sp, mcfg, src, kv_first=True)
    if any(k in mcfg for k in ("num_experts", "num_local_experts")):
        raise ConfigError(
            f"strategy.sp: {sp} with a mixture-of-experts model ({src}) is not in this build "
            "(the router's aux loss would see one worker's share of the tokens); use sp: 1"
        )


def _check_heads(
    field: str, what: str, ways: int, mcfg: dict[str, Any], src: str, kv_first: bool
) -> None:
    """Both tp and sp hand each worker whole attention heads and whole KV heads: `ways`
    must divide both (sp names the KV heads first: they are the tighter bound)."""
    heads = mcfg.get("num_attention_heads")
    kv = mcfg.get("num_key_value_heads") or heads
    if not isinstance(heads, int):
        raise ConfigError(
            f"strategy.{field}: {src} has no num_attention_heads; {what} needs a "
            "decoder with attention heads (Llama, Mistral, Qwen2 families)"
        )
    pairs = [("num_attention_heads", heads), ("num_key_value_heads", kv)]
    for name, n in reversed(pairs) if kv_first else pairs:
        if n % ways:
            raise ConfigError(
                f"strategy.{field}: {ways} does not divide the model's {name} {n} ({src}); "
                f"use a divisor of {n}"
            )
