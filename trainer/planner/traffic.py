"""What one rank sends over the network per optimizer step, by mesh dim (dp, tp, pp): the
plan's communication line. Beside memory, not in it: both read the job's Setup and the
model's shape, neither reads the other.
"""

from __future__ import annotations

from trainer.planner.setup import Setup, rank_params
from trainer.planner.shape import QLORA_BYTES_PER_PARAM, ModelShape


def communication(shape: ModelShape, s: Setup) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by mesh dim (ring collectives: an
    all-gather or reduce-scatter of B bytes sends B·(n-1)/n, an all-reduce twice that).

    - dp: FSDP all-gathers the rank's share of weights each micro step (again in backward
      when it reshards after forward; not under pp) and reduce-scatters fp32 gradients
      once; DDP all-reduces fp32 gradients.
    - tp: two all-reduces of the hidden state per decoder layer in forward, two in
      backward, for every token of the micro batch.
    - pp: the hidden state forward and its gradient back across each stage boundary this
      rank owns, per token.
    With ranks laid out (dp, pp, tp), tp groups are consecutive ranks (inside a node when
    tp <= GPUs per node); dp traffic crosses nodes as soon as there is more than one."""
    c, a = s.c, s.grad_accum
    tokens = s.micro_batch * s.block_size
    if s.adapter != "none":
        return {"dp": _adapter_traffic(shape, s), "tp": 0.0, "pp": 0.0}
    if s.strategy == "ddp":
        n = s.world
        return {"dp": 2 * 4.0 * shape.params * (n - 1) / n, "tp": 0.0, "pp": 0.0}
    if s.strategy != "fsdp":
        return {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    share, _, _ = rank_params(shape, s)
    dp = max(1, s.world // (s.tp * s.pp))
    gathers = 1 if (s.pp > 1 or not s.fsdp_reshard) else 2
    dp_bytes = (a * gathers * c * share + 4 * share) * (dp - 1) / dp
    tp_bytes = a * (shape.layers / s.pp) * 4 * tokens * shape.hidden * c * 2 * (s.tp - 1) / s.tp
    stages = 2 if s.pp_schedule in ("interleaved_1f1b", "zbv") else 1
    pp_bytes = a * 2 * stages * tokens * shape.hidden * c if s.pp > 1 else 0.0
    return {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_bytes}


def _adapter_traffic(shape: ModelShape, s: Setup) -> float:
    """Adapters: DDP all-reduces the adapter gradients; FSDP2 and ZeRO-3 also all-gather
    the frozen base (NF4 under QLoRA) in forward and again in backward, each micro step."""
    n = s.world
    lora = shape.lora_params(s.lora_r, list(s.lora_targets))
    share = (n - 1) / n
    if s.strategy in ("ddp", "zero2"):
        return 2 * 4.0 * lora * share
    quantized = shape.layers * shape.layer_linear_params
    if s.adapter == "qlora":
        base = QLORA_BYTES_PER_PARAM * quantized + s.c * (shape.params - quantized)
    else:
        base = float(s.c * shape.params)
    return (s.grad_accum * 2 * (base + s.c * lora) + 4.0 * lora) * share
