"""Memory and cost planner: will this job fit, on which nodes, and what will an epoch cost.

Pure (standard library, pydantic/PyYAML through the config and the catalog; no torch,
Ray, numpy or pyarrow), so `tools/submit.py` runs it on a laptop before anything is
submitted and `python -m trainer plan` runs it on a cluster node. Every formula below is
written out, with its source, in the README section "Planning memory and cost"; the
constants are named here so the README and the code say the same thing.

Sizes are bytes unless a name says otherwise. M = all parameters, P = trainable
parameters, N = ranks (workers), K = ranks on one node, T = tokens per micro batch
(micro_batch_size × block_size), c = bytes of the compute dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from trainer.catalog import InstanceType, get_instance, load_instances
from trainer.config import DeepSpeedOptions, FSDPOptions, JobConfig
from trainer.errors import UserError
from trainer.flops import PEAK_FLOPS

GIB = 1024**3

# ---------------------------------------------------------------- stated constants
GPU_OVERHEAD = 1.5 * GIB
"""Per GPU rank, outside the model: CUDA context (~0.5 GiB), cuBLAS workspaces and NCCL
buffers (~0.5 GiB), caching-allocator fragmentation (~0.5 GiB)."""
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

    @classmethod
    def from_hf_config(cls, conf: dict[str, Any], where: str = "config.json") -> ModelShape:
        text = conf.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in conf:
            conf = text
        try:
            heads = int(conf["num_attention_heads"])
            model_type = str(conf.get("model_type", ""))
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
        """(in, out) of each linear in one decoder layer, by its module name."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden * self.o_bias
        bias += (2 * self.intermediate + self.hidden) * self.mlp_bias
        return self.layer_linear_params + bias + 2 * self.hidden  # + two RMSNorm weights

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
    def root_params(self) -> int:
        """What is not in a decoder layer: embeddings, final norm, lm_head."""
        return max(self.params - self.layers * self.layer_params, 0)

    def lora_params(self, r: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(r * (a + b) for n, (a, b) in shapes.items() if n in targets)


_REFERENCE_SHAPES = (
    ModelShape(2048, 22, 32, 4, 5632, 32000),  # TinyLlama-1.1B
    ModelShape(4096, 32, 32, 32, 11008, 32000),  # Llama-2-7B
    ModelShape(5120, 40, 40, 40, 13824, 32000),  # Llama-2-13B
    ModelShape(8192, 80, 64, 8, 28672, 32000),  # Llama-2-70B
)


def shape_for_job(cfg: JobConfig, read_text: Any = None) -> ModelShape:
    """The model's shape from its config.json (a local folder, or through `read_text` for
    s3://), with the vocabulary grown by the job's special tokens when they are readable."""
    src = cfg.model.path.rstrip("/") + "/config.json"
    if cfg.model.path.startswith("s3://"):
        if read_text is None:
            raise ShapeUnavailable(f"{src}: not readable here; pass --params to plan without it")
        text = read_text(src)
    else:
        path = Path(src).expanduser()
        if not path.is_file():
            raise ShapeUnavailable(f"{path}: not found; pass --params to plan without it")
        text = path.read_text()
    try:
        shape = ModelShape.from_hf_config(json.loads(text), src)
    except json.JSONDecodeError as exc:
        raise UserError(f"{src}:{exc.lineno}: not valid JSON") from None
    extra = _special_token_count(cfg.model.special_tokens)
    if extra:
        # An upper bound: tokens the tokenizer already has do not grow the vocabulary.
        shape = ModelShape(**{**asdict(shape), "vocab": shape.vocab + extra})
    return shape


def _special_token_count(path: str | None) -> int:
    if not path or "://" in path or not Path(path).expanduser().is_file():
        return 0
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    tokens = data.get("tokens", []) if isinstance(data, dict) else data
    return len(tokens) if isinstance(tokens, list) else 0


# ---------------------------------------------------------------- the job, as memory sees it


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
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    merge_on_export: bool = False
    fsdp_reshard: bool = True
    fsdp_cpu_offload: bool = False
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    """Pipeline microbatches each micro batch is cut into (FSDP with pp > 1)."""
    grad_accum: int = 1
    offload_optimizer: str = "none"  # DeepSpeed: none | cpu | nvme
    offload_param: str = "none"

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
            from trainer import dsconfig

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
            micro_batch=cfg.train.micro_batch_size,
            block_size=cfg.data.block_size,
            checkpointing=ckpt,
            eager_attention=cfg.model.attn_implementation == "eager",
            lora_r=cfg.model.lora.r,
            lora_targets=tuple(cfg.model.lora.target_modules),
            merge_on_export=cfg.model.lora.merge_on_export,
            grad_accum=cfg.train.grad_accum,
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


@dataclass
class RankMemory:
    """One rank's device memory (GPU, or host RAM for a CPU rank), by what holds it."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    activations_no_ckpt: float
    activations_ckpt: float
    checkpointing: bool
    gradients_held: float = 0.0
    """The part of `gradients` that stays allocated through the whole step (DDP's bucket
    buffers, DeepSpeed's gradient partitions and reduce buckets)."""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """The peak. Backward frees each layer's saved activations as it fills that layer's
        gradients (which are freed again after the optimizer step), so the two do not peak
        together: the larger of them counts, on top of what is held all step. Measured on
        CPU (tests/bench/test_bench_planner.py) this is within a few percent, where the
        plain sum over-predicted every case by 17-28%."""
        transient = max(self.gradients - self.gradients_held, self.activations)
        return self.weights + self.optimizer + self.overhead + self.gradients_held + transient


@dataclass
class HostMemory:
    """Host RAM one rank adds to its node, at load time and while training."""

    offload: float
    load: float
    process: float
    export: float
    """Only on rank 0's node: the full model consolidated on CPU to write the export."""
    staging: float = 0.0
    """Every rank: the host-memory copy of its resume state that a checkpoint stages
    while the background thread writes it (trainer.staging): FSDP's shard, ZeRO's
    optimizer partition."""
    staging_rank0: float = 0.0
    """Rank 0 only: the same for DDP and adapters, whose rank 0 writes the whole state,
    and ZeRO-2's module weights."""


def activation_bytes(shape: ModelShape, s: Setup, checkpointing: bool) -> float:
    """Saved activations of one micro batch, plus the logits/loss buffers.

    Per token and decoder layer (Llama layout, SDPA attention, no dropout):
      c·(2h + 2·q_dim + 2·kv_dim + 4·I)   inputs of q/k/v and of gate/up; q, k, v and the
                                          attention output; gate, up, silu(gate), product
      + 2·(4 + r)·h                       two RMSNorms: fp32 upcast + normalised output
      + heads·s·(4 + c) with eager attention (fp32 softmax probabilities + their cast)
    where r is the residual stream's bytes (4 where weights are fp32 under autocast).
    With activation checkpointing a layer keeps only its input (r·h per token) and one
    layer's full set is rebuilt at a time in backward. The head keeps the final norm,
    and the logits: c (lm_head output) + 4 (log_softmax output) + 4 + 4 (its gradient and
    the logits' gradient in fp32) bytes per vocabulary entry and token.
    """
    h, c = shape.hidden, s.c
    t = s.micro_batch * s.block_size
    r = _residual_bytes(s)
    inputs, product = 2 * h, shape.intermediate
    if s.adapter != "none":
        # A frozen linear's backward needs only its weight: its input is kept only where
        # a LoRA adapter on it trains (q/k/v share one input, gate/up another, down's is
        # the gate·up product).
        targets = set(s.lora_targets)
        inputs = h * (
            bool(targets & {"q_proj", "k_proj", "v_proj"})
            + bool(targets & {"gate_proj", "up_proj"})
        )
        product = shape.intermediate if "down_proj" in targets else 0
    per_layer = c * (inputs + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate + product)
    per_layer += 2 * (4 + r) * h
    if s.eager_attention:
        per_layer += shape.heads * s.block_size * (4 + c)
    head = (4 + r) * h + r * h + (c + 12) * shape.vocab
    layers = shape.layers * r * h + per_layer if checkpointing else shape.layers * per_layer
    return float(t * (layers + head))


def _residual_bytes(s: Setup) -> int:
    if not s.gpu:
        return 4
    if s.strategy == "ddp" and s.adapter in ("none", "qlora"):
        return 4  # fp32 master weights under autocast (qlora: fp32 embeddings and norms)
    return s.c


def rank_memory(shape: ModelShape, s: Setup) -> RankMemory:
    m, n, c, o = shape.params, s.world, s.c, s.optim_bytes
    notes: list[str] = []
    held = 0.0
    if s.adapter != "none":
        w, g, opt, notes = _adapter_memory(shape, s)
        held = g / 2 if s.world > 1 else 0.0  # DDP's buckets for the adapter gradients
    elif s.strategy == "ddp":
        w = 4.0 * m
        if s.mixed:
            w += c * (shape.layers * shape.layer_linear_params + shape.embedding_params)
            notes.append("weights include autocast's compute-dtype copies of the matmul weights")
        g = 4.0 * m * (2 if n > 1 else 1)
        held = 4.0 * m if n > 1 else 0.0
        if n > 1:
            notes.append("gradients include DDP's bucket buffers (same size as the gradients)")
        opt = float(o * m)
    elif s.strategy == "fsdp" and s.tp * s.pp > 1:
        w, g, opt, notes = _model_parallel_memory(shape, s)
    elif s.strategy == "fsdp":
        p = c
        live = shape.params if not s.fsdp_reshard else 2 * shape.layer_params
        gathered = p * (shape.root_params + live)
        shards = 0.0 if s.fsdp_cpu_offload else 1.0
        w = shards * 4 * m / n + gathered
        g = shards * 4 * m / n + p * (shape.root_params + shape.layer_params)
        opt = shards * o * m / n
        notes.append("weights include the gathered root and two decoder layers in flight")
    else:  # DeepSpeed ZeRO-2 / ZeRO-3
        bucket = 2 * c * shape.hidden**2  # reduce buckets (hidden², double-buffered)
        master = 4 if s.mixed else 0
        on_gpu_opt = 0.0 if s.offload_optimizer != "none" else 1.0
        if s.strategy == "zero2":
            w = float(c * m)
        else:
            biggest = max(shape.layer_params, shape.embedding_params)
            on_gpu_param = 0.0 if s.offload_param != "none" else 1.0
            w = on_gpu_param * c * m / n + c * 2 * biggest
            notes.append("weights include the two largest modules gathered (current, prefetch)")
        g = on_gpu_opt * c * m / n + bucket
        held = g  # DeepSpeed allocates its partitions and buckets once, for the whole run
        opt = on_gpu_opt * (master + o) * m / n
    act_full = _stage_activations(shape, s, False)
    act_ckpt = _stage_activations(shape, s, True)
    overhead = GPU_OVERHEAD if s.gpu else CPU_RANK_OVERHEAD
    return RankMemory(
        weights=w,
        gradients=g,
        optimizer=opt,
        activations=act_ckpt if s.checkpointing else act_full,
        overhead=overhead,
        activations_no_ckpt=act_full,
        activations_ckpt=act_ckpt,
        checkpointing=s.checkpointing,
        gradients_held=held,
        notes=[
            *notes,
            "total: gradients fill as backward frees the activations, so the larger counts",
        ],
    )


def _rank_params(shape: ModelShape, s: Setup) -> tuple[float, float, float]:
    """(parameters one rank's model-parallel share holds before dp sharding, of which in
    one decoder layer, of which outside the layers). TP splits the decoder matrices over
    tp; embeddings, norms and lm_head stay whole (replicated over tp). PP gives each rank
    layers / pp layers, and the worst rank one of the embedding and the LM head."""
    layer = shape.layer_params / s.tp
    root = shape.root_params if s.pp == 1 else shape.root_params / 2
    return shape.layers / s.pp * layer + root, layer, root


def _model_parallel_memory(shape: ModelShape, s: Setup) -> tuple[float, float, float, list[str]]:
    """FSDP2 over dp of a (pp, tp) model-parallel share. Under pp the stage's weights stay
    gathered through the step (every microbatch in flight uses them) and its gradients
    accumulate unsharded until the last microbatch's backward."""
    c, o = s.c, s.optim_bytes
    share, layer, root = _rank_params(shape, s)
    dp = max(1, s.world // (s.tp * s.pp))
    live = share if (s.pp > 1 or not s.fsdp_reshard) else root + 2 * layer
    weights = 4 * share / dp + c * live
    grads = 4 * share / dp + (c * share if s.pp > 1 else c * (root + layer))
    notes = [
        f"(dp {dp}, pp {s.pp}, tp {s.tp}): this rank holds {_short(int(share))} parameters "
        f"before sharding over dp"
    ]
    return weights, grads, float(o * share / dp), notes


def _in_flight(s: Setup) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak: all of them for
    GPipe, up to pp for 1F1B and ZB-V, and for interleaved 1F1B (v = 2 stages per rank)
    Megatron's pp · (1 + (pp - 1) / (pp · v))."""
    m, pp = s.microbatches, s.pp
    if s.pp_schedule == "gpipe":
        return float(m)
    if s.pp_schedule == "interleaved_1f1b":
        return min(m, pp) * (1 + (pp - 1) / (pp * 2))
    return float(min(m, pp))


def _stage_activations(shape: ModelShape, s: Setup, checkpointing: bool) -> float:
    """Activations of one rank: `activation_bytes` with the local heads and MLP width
    under tp (the layer inputs and norms stay whole: no sequence parallelism), and under
    pp the stage's layers for every microbatch in flight, the logits for one (for all
    under GPipe)."""
    if s.strategy != "fsdp" or s.tp * s.pp == 1:
        return activation_bytes(shape, s, checkpointing)
    local = replace(
        shape,
        heads=max(1, shape.heads // s.tp),
        kv_heads=max(1, shape.kv_heads // s.tp),
        intermediate=shape.intermediate // s.tp,
        head_dim=shape.hd,
        layers=max(1, shape.layers // s.pp),
    )
    if s.pp == 1:
        return activation_bytes(local, s, checkpointing)
    mb = replace(s, micro_batch=max(1, s.micro_batch // s.microbatches))
    head = activation_bytes(replace(local, layers=0), mb, False)
    layers = activation_bytes(local, mb, checkpointing) - head
    heads_held = s.microbatches if s.pp_schedule == "gpipe" else 1
    return _in_flight(s) * layers + heads_held * head


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
    if s.strategy == "ddp" or s.adapter != "none":
        n = s.world
        return {"dp": 2 * 4.0 * shape.params * (n - 1) / n, "tp": 0.0, "pp": 0.0}
    if s.strategy != "fsdp":
        return {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    share, _, _ = _rank_params(shape, s)
    dp = max(1, s.world // (s.tp * s.pp))
    gathers = 1 if (s.pp > 1 or not s.fsdp_reshard) else 2
    dp_bytes = (a * gathers * c * share + 4 * share) * (dp - 1) / dp
    tp_bytes = a * (shape.layers / s.pp) * 4 * tokens * shape.hidden * c * 2 * (s.tp - 1) / s.tp
    stages = 2 if s.pp_schedule in ("interleaved_1f1b", "zbv") else 1
    pp_bytes = a * 2 * stages * tokens * shape.hidden * c if s.pp > 1 else 0.0
    return {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_bytes}


def _adapter_memory(shape: ModelShape, s: Setup) -> tuple[float, float, float, list[str]]:
    """Frozen base + trainable adapters (replicated: adapters compose with DDP)."""
    m, c = shape.params, s.c
    lora = shape.lora_params(s.lora_r, list(s.lora_targets))
    if s.adapter == "qlora":
        quantized = shape.layers * shape.layer_linear_params
        base = QLORA_BYTES_PER_PARAM * quantized + 4.0 * (m - quantized)
        # bitsandbytes dequantizes one weight at a time to the compute dtype for its matmul.
        base += c * max(a * b for a, b in shape.linear_shapes().values())
        notes = [
            "4-bit nf4 linears with double quantization; embeddings, lm_head and norms in "
            "fp32 (prepare_model_for_kbit_training)"
        ]
    else:
        base = float(c * m)
        notes = ["frozen base in the compute dtype"]
    weights = base + 4.0 * lora
    grads = 4.0 * lora * (2 if s.world > 1 else 1)
    return weights, grads, float(s.optim_bytes * lora), notes


def host_memory(shape: ModelShape, s: Setup, rank: RankMemory) -> HostMemory:
    """Host RAM per rank. A CPU rank's whole footprint is host RAM."""
    m, n, c, o = shape.params, s.world, s.c, s.optim_bytes
    staged = _staging_bytes(shape, s)
    if not s.gpu:
        return HostMemory(
            offload=0.0,
            load=0.0,
            process=rank.total,
            export=_export_bytes(shape, s),
            **staged,
        )
    offload = 0.0
    if s.adapter == "none" and s.strategy == "fsdp" and s.fsdp_cpu_offload:
        offload = (4 + 4 + o) * m / n  # fp32 param shards, fp32 grad shards, Adam state
    elif s.adapter == "none" and s.strategy in ("zero2", "zero3"):
        master = 4 if s.mixed else 0
        if s.offload_optimizer == "cpu":
            offload += (master + o + 4) * m / n  # master, Adam moments, fp32 grad partition
        if s.strategy == "zero3" and s.offload_param == "cpu":
            offload += c * m / n  # the compute-dtype parameter partition
    # Loading: DDP and ZeRO-2 build the whole model in host RAM on every rank, then move it.
    if s.adapter == "lora":
        load = float(c * m)
    elif s.adapter == "qlora":
        load = 0.0  # quantized shard by shard onto the GPU
    elif s.strategy in ("ddp", "zero2"):
        load = 4.0 * m
    else:
        load = 0.0  # FSDP: meta skeleton + mmapped shards; ZeRO-3: partitioned init
    return HostMemory(
        offload=offload,
        load=load,
        process=HOST_PER_GPU_PROCESS,
        export=_export_bytes(shape, s),
        **staged,
    )


def _staging_bytes(shape: ModelShape, s: Setup) -> dict[str, float]:
    """The staging copy of one checkpoint (trainer.staging): fp32 trainable weights and
    their optimizer state, in host RAM until the background write is done. FSDP stages
    each rank's shard (DCP async_save); DDP and adapters stage on rank 0 only; ZeRO-2/3
    stage each rank's optimizer partition (fp32 master + moments: what DeepSpeed's
    save_checkpoint hands its checkpoint engine), and under ZeRO-2 rank 0 also the module
    state dict in the compute dtype (ZeRO-3 saves placeholders there)."""
    if s.adapter != "none":
        lora = shape.lora_params(s.lora_r, list(s.lora_targets))
        return {"staging_rank0": float((4 + s.optim_bytes) * lora)}
    if s.strategy == "ddp":
        return {"staging_rank0": float((4 + s.optim_bytes) * shape.params)}
    if s.strategy == "fsdp":
        share, _, _ = _rank_params(shape, s)
        dp = max(s.world // (s.tp * s.pp), 1)
        return {"staging": float((4 + s.optim_bytes) * share / dp)}
    partition = {"staging": float((4 + s.optim_bytes) * shape.params / s.world)}
    if s.strategy == "zero2":
        return {**partition, "staging_rank0": float(s.c * shape.params)}
    return partition


def _export_bytes(shape: ModelShape, s: Setup) -> float:
    """Rank 0 consolidates the export in host RAM: the full fp32 model (FSDP's gathered
    state dict, DDP's safetensors serialisation), the 16-bit gather under DeepSpeed, or
    only the adapter (plus a fresh fp32 base and its serialisation when merging)."""
    m = shape.params
    if s.adapter != "none":
        extra = 8.0 * m if s.merge_on_export else 0.0
        return 4.0 * shape.lora_params(s.lora_r, list(s.lora_targets)) + extra
    if s.strategy in ("zero2", "zero3"):
        return float(s.c * m)
    return 4.0 * m


# ---------------------------------------------------------------- layouts, verdicts, cost


def verdict(need: float, capacity: float) -> Verdict:
    if capacity <= 0 or need > capacity:
        return "does not fit"
    return "tight" if need > TIGHT * capacity else "fits"


@dataclass
class NodeCheck:
    instance: str
    count: int
    ranks_per_node: int
    rank0: bool
    gpu_need: float
    gpu_capacity: float
    gpu_verdict: Verdict | None
    host_need: float
    host_capacity: float
    host_verdict: Verdict
    usd_per_hour: float
    spot_usd_per_hour: float
    large_cpu_mem: bool = False
    """Rank 0's own node type (the large_cpu_mem pool), bought on demand."""

    @property
    def verdict(self) -> Verdict:
        vs = [self.host_verdict] + ([self.gpu_verdict] if self.gpu_verdict else [])
        return max(vs, key=lambda v: _ORDER[v])


@dataclass
class Layout:
    world: int
    nodes: list[NodeCheck]
    tokens_per_s: float | None
    tokens_per_s_source: str

    @property
    def verdict(self) -> Verdict:
        return max((x.verdict for x in self.nodes), key=lambda v: _ORDER[v])

    @property
    def usd_per_hour(self) -> float:
        return sum(x.count * x.usd_per_hour for x in self.nodes)

    @property
    def spot_usd_per_hour(self) -> float:
        """Worker pools on spot; rank 0's large_cpu_mem node stays on demand (infra)."""
        return sum(
            x.count * (x.usd_per_hour if x.large_cpu_mem else x.spot_usd_per_hour)
            for x in self.nodes
        )

    def epoch(self, tokens: int | None) -> dict[str, float] | None:
        if not tokens or not self.tokens_per_s:
            return None
        hours = tokens / self.tokens_per_s / 3600
        return {
            "hours": hours,
            "usd_on_demand": hours * self.usd_per_hour,
            "usd_spot": hours * self.spot_usd_per_hour,
        }

    def describe(self) -> str:
        parts = [f"{x.count}× {x.instance}" + (" (rank 0)" if x.rank0 else "") for x in self.nodes]
        return f"{self.world} workers on " + " + ".join(parts)


def flops_per_token(shape: ModelShape, s: Setup) -> float:
    """6·M for full training (2·M forward, 4·M backward); 4·M with a frozen base (no
    weight gradients); +2·M when activation checkpointing recomputes the forward."""
    base = 4.0 if s.adapter != "none" else 6.0
    return (base + (2.0 if s.checkpointing else 0.0)) * shape.params


def throughput(
    shape: ModelShape, s: Setup, inst: InstanceType, mfu: float | None
) -> tuple[float | None, str]:
    """Tokens/s per rank from the catalog GPU's peak FLOP/s at an assumed MFU."""
    if not inst.gpu_model or not s.gpu:
        return None, "no peak FLOP/s for CPU nodes: pass --tokens-per-s"
    peak = PEAK_FLOPS.get(inst.gpu_model, {}).get(s.precision)
    if peak is None:
        return None, f"no peak FLOP/s for {inst.gpu_model} {s.precision}: pass --tokens-per-s"
    mfu = mfu if mfu is not None else (OFFLOAD_MFU if s.offloaded else DEFAULT_MFU)
    tps = peak * mfu / flops_per_token(shape, s)
    return tps, f"{peak / 1e12:.0f} TFLOP/s {inst.gpu_model} × MFU {mfu:.0%}"


def _ranks_on(inst: InstanceType, s: Setup, ranks_per_node: int | None, left: int) -> int:
    if ranks_per_node:
        k = ranks_per_node
    elif s.gpu:
        k = inst.gpu_count
    else:
        k = left  # CPU ranks: all on one node unless told otherwise
    return max(1, min(k, left))


def layout(
    shape: ModelShape,
    s: Setup,
    instance: str,
    rank0_instance: str | None = None,
    ranks_per_node: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
) -> Layout:
    """Place `s.world` ranks: rank 0's node first (its own type if given), then the pool."""
    rank = rank_memory(shape, s)
    host = host_memory(shape, s, rank)
    nodes: list[NodeCheck] = []
    left = s.world
    groups: list[tuple[InstanceType, bool]] = []
    if rank0_instance and rank0_instance != instance:
        groups.append((get_instance(rank0_instance), True))
    groups.append((get_instance(instance), not groups))
    for i, (inst, has_rank0) in enumerate(groups):
        if s.gpu and inst.gpu_count == 0:
            raise UserError(f"{inst.name}: has no GPU but the job sets scaling.use_gpu")
        k = _ranks_on(inst, s, ranks_per_node, left)
        count = math.ceil(left / k) if i == len(groups) - 1 else 1
        for node_index in range(count):
            on_node = min(k, left)
            left -= on_node
            rank0_here = has_rank0 and node_index == 0
            need = _host_need(host, on_node, rank0_here)
            check = NodeCheck(
                instance=inst.name,
                count=1,
                ranks_per_node=on_node,
                rank0=rank0_here,
                gpu_need=rank.total if s.gpu else 0.0,
                gpu_capacity=inst.gpu_memory_gib * GIB,
                gpu_verdict=verdict(rank.total, inst.gpu_memory_gib * GIB) if s.gpu else None,
                host_need=need,
                host_capacity=inst.ram_gib * GIB,
                host_verdict=verdict(need, inst.ram_gib * GIB),
                usd_per_hour=inst.on_demand_usd_per_hour,
                spot_usd_per_hour=inst.spot_usd_per_hour,
                large_cpu_mem=rank0_here and len(groups) > 1,
            )
            _merge_node(nodes, check)
            if left == 0:
                break
    pool = get_instance(instance)
    if tokens_per_s is not None:
        tps, source = tokens_per_s, "given"
    else:
        per_rank, source = throughput(shape, s, pool, mfu)
        tps = per_rank * s.world if per_rank is not None else None
    return Layout(world=s.world, nodes=nodes, tokens_per_s=tps, tokens_per_s_source=source)


def _host_need(host: HostMemory, ranks: int, rank0: bool) -> float:
    """Peak of the load phase and the training phase (plus the export on rank 0's node)."""
    steady = ranks * (host.process + host.offload + host.staging) + (
        host.export + host.staging_rank0 if rank0 else 0.0
    )
    loading = ranks * (host.process + host.load)
    return HOST_NODE_RESERVE + max(steady, loading)


def _merge_node(nodes: list[NodeCheck], check: NodeCheck) -> None:
    """Identical nodes are one row with a count."""
    for x in nodes:
        same = (x.instance, x.ranks_per_node, x.rank0) == (
            check.instance,
            check.ranks_per_node,
            check.rank0,
        )
        if same and not check.rank0:
            x.count += 1
            return
    nodes.append(check)


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    shape: ModelShape
    setup: Setup
    params: int
    trainable: int
    rank: RankMemory
    host: HostMemory
    layout: Layout | None
    cheapest: Layout | None
    tokens_per_epoch: int | None
    notes: list[str] = field(default_factory=list)
    comm: dict[str, float] = field(default_factory=dict)
    """Bytes per rank per optimizer step, by mesh dim (see `communication`)."""

    @property
    def refused(self) -> bool:
        """What submit refuses: the chosen layout does not fit, or (with none chosen) no
        catalog layout at this worker count does."""
        if self.layout is not None:
            return self.layout.verdict == "does not fit"
        return self.setup.gpu and (self.cheapest is None or self.cheapest.world != self.setup.world)

    def to_dict(self) -> dict[str, Any]:
        def lay(x: Layout | None) -> dict[str, Any] | None:
            if x is None:
                return None
            return {
                "describe": x.describe(),
                "world": x.world,
                "verdict": x.verdict,
                "usd_per_hour": x.usd_per_hour,
                "spot_usd_per_hour": x.spot_usd_per_hour,
                "tokens_per_s": x.tokens_per_s,
                "tokens_per_s_source": x.tokens_per_s_source,
                "epoch": x.epoch(self.tokens_per_epoch),
                "nodes": [{**asdict(n), "verdict": n.verdict} for n in x.nodes],
            }

        return {
            "params": self.params,
            "trainable_params": self.trainable,
            "setup": asdict(self.setup),
            "rank_memory": {**asdict(self.rank), "total": self.rank.total},
            "host_per_rank": asdict(self.host),
            "layout": lay(self.layout),
            "cheapest": lay(self.cheapest),
            "tokens_per_epoch": self.tokens_per_epoch,
            "refused": self.refused,
            "notes": self.notes,
            "comm_bytes_per_step": self.comm,
        }


WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)


def plan(
    shape: ModelShape,
    s: Setup,
    instance: str | None = None,
    rank0_instance: str | None = None,
    ranks_per_node: int | None = None,
    tokens_per_epoch: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
    search: bool = True,
) -> Plan:
    rank = rank_memory(shape, s)
    trainable = (
        shape.params if s.adapter == "none" else shape.lora_params(s.lora_r, list(s.lora_targets))
    )
    chosen = None
    if instance:
        chosen = layout(shape, s, instance, rank0_instance, ranks_per_node, tokens_per_s, mfu)
    cheapest = cheapest_layout(shape, s, rank0_instance, tokens_per_epoch, mfu) if search else None
    notes = list(rank.notes)
    if cheapest is not None and cheapest.world != s.world:
        notes.append(
            f"nothing in the catalog fits {s.world} workers; the cheapest layout that fits "
            f"uses {cheapest.world} (keep the global batch with grad_accum)"
        )
    return Plan(
        shape=shape,
        setup=s,
        params=shape.params,
        trainable=trainable,
        rank=rank,
        host=host_memory(shape, s, rank),
        layout=chosen,
        cheapest=cheapest,
        tokens_per_epoch=tokens_per_epoch,
        notes=notes,
        comm=communication(shape, s),
    )


def cheapest_layout(
    shape: ModelShape,
    s: Setup,
    rank0_instance: str | None = None,
    tokens_per_epoch: int | None = None,
    mfu: float | None = None,
) -> Layout | None:
    """The cheapest catalog layout that fits at the job's worker count; failing that, at
    the smallest power-of-two count that fits. Cost is per epoch when the epoch's tokens
    and a throughput are known, else per hour; 'fits' beats 'tight'."""
    family = ("gpu",) if s.gpu else ("compute", "memory", "general")
    types = [t for t in load_instances().values() if t.family in family]
    sizes = [s.world] + [w for w in WORLD_SIZES if w > s.world]
    for world in sizes:
        sw = Setup(**{**asdict(s), "world": world})
        found = []
        for t in types:
            lay = layout(shape, sw, t.name, rank0_instance, None, None, mfu)
            if lay.verdict != "does not fit":
                found.append(lay)
        if found:

            def cost(x: Layout) -> tuple[int, float]:
                e = x.epoch(tokens_per_epoch)
                return (_ORDER[x.verdict], e["usd_on_demand"] if e else x.usd_per_hour)

            return min(found, key=cost)
    return None


def plan_job(
    cfg: JobConfig,
    instance: str | None = None,
    *,
    rank0_instance: str | None = None,
    params: int | None = None,
    ranks_per_node: int | None = None,
    tokens_per_epoch: int | None = None,
    tokens_per_s: float | None = None,
    mfu: float | None = None,
    read_text: Any = None,
) -> Plan:
    """The plan for a validated job config (the entry point of the CLIs and submit)."""
    shape = ModelShape.from_params(params) if params else shape_for_job(cfg, read_text)
    return plan(
        shape,
        Setup.from_config(cfg),
        instance=instance,
        rank0_instance=rank0_instance,
        ranks_per_node=ranks_per_node,
        tokens_per_epoch=tokens_per_epoch,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
    )


# ---------------------------------------------------------------- text output


def gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _short(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_plan(p: Plan) -> str:
    """The plan as plain text (the trainer side prints this; tools/plan.py uses rich)."""
    s, r = p.setup, p.rank
    adapter = "" if s.adapter == "none" else f" + {s.adapter} r={s.lora_r}"
    offload = []
    if s.fsdp_cpu_offload:
        offload.append("cpu_offload")
    if s.offload_optimizer != "none":
        offload.append(f"optimizer→{s.offload_optimizer}")
    if s.offload_param != "none":
        offload.append(f"params→{s.offload_param}")
    where = "GPU" if s.gpu else "host RAM"
    lines = [
        f"model {_short(p.params)} params ({_short(p.trainable)} trainable), {s.strategy}"
        f"{adapter}{' ' + ', '.join(offload) if offload else ''}, {s.precision}, "
        f"{s.optimizer}, {s.world} workers, micro batch {s.micro_batch} × {s.block_size} "
        f"tokens, activation checkpointing {'on' if s.checkpointing else 'off'}",
        "",
        f"per rank ({where})",
        f"  weights            {gib(r.weights):>12}",
        f"  gradients          {gib(r.gradients):>12}",
        f"  optimizer states   {gib(r.optimizer):>12}",
        f"  activations        {gib(r.activations):>12}   "
        f"(checkpointing off {gib(r.activations_no_ckpt)}, on {gib(r.activations_ckpt)})",
        f"  framework overhead {gib(r.overhead):>12}",
        f"  total              {gib(r.total):>12}",
        f"host RAM per rank: process {gib(p.host.process)}, offload {gib(p.host.offload)}, "
        f"load {gib(p.host.load)}, checkpoint staging {gib(p.host.staging)}; export on "
        f"rank 0's node {gib(p.host.export)}, staging on rank 0 {gib(p.host.staging_rank0)}",
    ]
    for title, lay in (("layout", p.layout), ("cheapest layout that fits", p.cheapest)):
        if lay is None:
            continue
        lines += ["", f"{title}: {lay.describe()}: {lay.verdict.upper()}"]
        lines.append(
            f"  {'node type':<22}{'count':>6}{'ranks':>6}  {'GPU need/have':>22}  "
            f"{'host need/have':>24}  verdict"
        )
        for n in lay.nodes:
            gpu = f"{gib(n.gpu_need)} / {n.gpu_capacity / GIB:.0f} GiB" if n.gpu_verdict else "-"
            host = f"{gib(n.host_need)} / {n.host_capacity / GIB:.0f} GiB"
            name = n.instance + (" (rank 0)" if n.rank0 else "")
            lines.append(
                f"  {name:<22}{n.count:>6}{n.ranks_per_node:>6}  {gpu:>22}  {host:>24}  {n.verdict}"
            )
        lines.append(
            f"  ${lay.usd_per_hour:.2f}/h on demand, ${lay.spot_usd_per_hour:.2f}/h on spot"
        )
        e = lay.epoch(p.tokens_per_epoch)
        if lay.tokens_per_s:
            lines.append(
                f"  throughput {lay.tokens_per_s:,.0f} tokens/s ({lay.tokens_per_s_source})"
            )
        if e:
            lines.append(
                f"  per epoch of {p.tokens_per_epoch:,} tokens: {e['hours']:.2f} h, "
                f"${e['usd_on_demand']:.2f} on demand, ${e['usd_spot']:.2f} on spot"
            )
    if p.layout is None and p.cheapest is None and s.gpu:
        lines += ["", "no catalog layout fits this job at up to 64 workers"]
    if any(p.comm.values()):
        lines.append(
            "sent per rank per step: "
            + ", ".join(f"{k} {gib(v)}" for k, v in p.comm.items() if v)
            + " (tp stays inside a node; dp and pp cross nodes)"
        )
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------- shared CLI arguments


def add_arguments(p: Any) -> None:
    """The planner's options, shared by `python -m trainer plan`, tools/plan.py and submit."""
    p.add_argument("--instance", help="worker pool instance type (catalog name), e.g. g5.xlarge")
    p.add_argument(
        "--rank0-instance",
        help="instance type of rank 0's large_cpu_mem node (default: the pool's type)",
    )
    p.add_argument("--ranks-per-node", type=int, help="default: the instance's GPU count")
    p.add_argument("--params", type=float, help="parameter count instead of config.json")
    p.add_argument("--tokens-per-epoch", type=float, help="tokens in one epoch")
    p.add_argument("--tokens-per-s", type=float, help="measured cluster throughput")
    p.add_argument(
        "--mfu",
        type=float,
        help=f"assumed MFU (default {DEFAULT_MFU}, {OFFLOAD_MFU} with CPU offload)",
    )


def plan_from_args(cfg: JobConfig, args: Any) -> Plan:
    def read_text(uri: str) -> str:
        from trainer.storage import read_text as read  # pyarrow: only for s3:// models

        return read(uri, cfg.storage.endpoint_override, cfg.storage.region)

    try:
        return plan_job(
            cfg,
            args.instance,
            rank0_instance=args.rank0_instance,
            params=int(args.params) if args.params else None,
            ranks_per_node=args.ranks_per_node,
            tokens_per_epoch=int(args.tokens_per_epoch) if args.tokens_per_epoch else None,
            tokens_per_s=args.tokens_per_s,
            mfu=args.mfu,
            read_text=read_text,
        )
    except KeyError as exc:  # an instance type the catalog does not have
        raise UserError(str(exc.args[0])) from None


def submit_refusal(cfg: JobConfig, args: Any) -> str | None:
    """What `tools/submit.py` prints instead of submitting: the plan's table when the job
    will not fit, else None. A model whose config.json is not readable from here (a
    shared-FS path on the cluster) is not planned, and not refused: preflight on the
    cluster still checks it exists."""
    import logging

    try:
        p = plan_from_args(cfg, args)
    except ShapeUnavailable as exc:
        logging.getLogger("raylift.plan").info("plan: skipped (%s)", exc)
        return None
    if not p.refused:
        return None
    return (
        format_plan(p)
        + "\nerror: the planner says this job will not fit (table above); change the "
        "layout or the job, or pass --force to submit anyway"
    )
