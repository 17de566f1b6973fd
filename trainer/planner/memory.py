"""The job as memory sees it: per-rank GPU memory (weights, gradients, optimizer state,
activations) and per-node host memory, each term written out with its source in the docs
page "Planning memory and cost".

Sizes are bytes unless a name says otherwise. M = all parameters, P = trainable
parameters, N = ranks (workers), K = ranks on one node, T = tokens per micro batch
(micro_batch_size × block_size), c = bytes of the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from trainer.planner import sequence
from trainer.planner.device import device_lines
from trainer.planner.setup import Setup as Setup  # re-exported: where callers always found it
from trainer.planner.setup import rank_params
from trainer.planner.shape import (
    CPU_RANK_OVERHEAD,
    HOST_NODE_RESERVE,
    HOST_PER_GPU_PROCESS,
    QLORA_BYTES_PER_PARAM,
    ModelShape,
    short_count,
)


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
    device: dict[str, float] = field(default_factory=dict)
    """GPU ranks: `overhead` by line (CUDA context, NCCL buffers, cuBLAS workspaces,
    allocator slack; trainer.planner.device), and what each is made of in `device_why`."""
    device_why: dict[str, str] = field(default_factory=dict)

    @property
    def tensors(self) -> float:
        """The modelled tensors' peak: everything but `overhead`."""
        return self.total - self.overhead

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
    while the background thread writes it (trainer.storage.staging): FSDP's shard, ZeRO's
    optimizer partition."""
    staging_rank0: float = 0.0
    """Rank 0 only: the same for DDP and adapters, whose rank 0 writes the whole state,
    and ZeRO-2's module weights."""
    keeper: float = 0.0
    """Every rank, with the RAM tier on (checkpoint.memory_every): what its share of the
    snapshots costs its node: the keeper's `KEEPER_COPIES` snapshots of it, as many of
    the share a rank of the buddy node sends, and `SNAPSHOT_IN_TRANSIT` copies in the
    rank itself while one travels (read from the staged folder, in the object store)."""
    keeper_node: float = 0.0
    """Once on every node, with the RAM tier on: the keeper's snapshots of rank 0's whole
    share under DDP and adapters (rank 0's node holds them; any other node may be its
    buddy, so every node counts them)."""

    def node_need(self, ranks: int, rank0: bool) -> float:
        """A node of `ranks` such ranks: the peak of the load phase and the training phase
        (plus the export on rank 0's node), with the node's own reserve."""
        steady = ranks * (self.process + self.offload + self.staging + self.keeper) + (
            self.export + self.staging_rank0 if rank0 else 0.0
        )
        steady += self.keeper_node  # the RAM tier: rank 0's snapshots, here or as buddy
        loading = ranks * (self.process + self.load)
        return HOST_NODE_RESERVE + max(steady, loading)


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
    and the loss its vocab-wide buffers (`logits_bytes`: all the logits with the plain
    loss, one chunk's with the chunked one).
    """
    h, c = shape.hidden, s.c
    t = sequence.local_tokens(s)  # sequence parallelism: this rank's share of the tokens
    r = _residual_bytes(s)
    inputs, product = 2 * h, shape.intermediate
    if s.adapter != "none":
        # A frozen linear's backward needs only its weight: its input is kept only where
        # a LoRA adapter on it trains (q/k/v share one input, gate/up another, down's is
        # the gate·up product).
        targets = set(shape.lora_targets(s.lora_targets))
        inputs = h * (
            bool(targets & {"q_proj", "k_proj", "v_proj", "qkv_proj"})
            + bool(targets & {"gate_proj", "up_proj", "gate_up_proj"})
        )
        product = shape.intermediate if "down_proj" in targets else 0
    per_layer = c * (inputs + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate + product)
    per_layer += shape.norms * (4 + r) * h  # two RMSNorms (Gemma 2/3: four)
    per_layer += shape.qk_norm * (4 + r) * (shape.q_dim + shape.kv_dim)  # Qwen3, Gemma 3
    if s.eager_attention:  # + the soft-capping tanh's output (Gemma 2)
        per_layer += shape.heads * s.block_size * (4 + c + c * bool(shape.attn_softcap))
    head = (4 + r) * h + r * h
    layers = shape.layers * r * h + per_layer if checkpointing else shape.layers * per_layer
    # Ulysses' all-to-all buffers live inside one layer's attention: without checkpointing
    # the peak is at the loss, so they count where they exceed its buffers; with it, a
    # layer rebuilt in backward exchanges again on top of everything counted here.
    loss, exchange = logits_bytes(shape, s, t), sequence.exchange_bytes(shape, s)
    transient = loss + exchange if checkpointing else max(loss, exchange)
    return float(t * (layers + head) + transient)


CHUNKED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
"""model_types whose causal LM trainer.objectives.linear_ce was checked against (its
CAUSAL_LMS; a unit test keeps the two lists one)."""


def chunked_loss(shape: ModelShape, s: Setup) -> bool:
    """Whether the run computes its loss chunk-wise (trainer.objectives.linear_ce.configure):
    train.loss chunked, or auto on a checked family; under tp (lm_head replicated) and on
    pp's last stage too (trainer.parallel.pipeline.last_stage_loss)."""
    if s.loss == "plain":
        return False
    return s.loss in ("chunked", "liger") or shape.model_type in (*CHUNKED_FAMILIES, "")


def logits_bytes(shape: ModelShape, s: Setup, tokens: int) -> float:
    """The loss's vocab-wide buffers for a micro batch of `tokens`.

    Plain (the model's own loss): per token and vocabulary entry, c (lm_head output) + 4
    (its fp32 upcast / log_softmax output) + 4 + 4 (their gradients in fp32), + c for a
    softcap's tanh. Chunked: one chunk of `loss_chunk` tokens at a time, each holding one
    fp32 buffer (its logits, turned in place into their softmax and gradient: 4 bytes),
    in mixed precision the matmul's output and the gradient's cast (c), and tanh's value
    under a softcap (4); plus what it keeps from forward to backward: the gradient wrt the
    hidden states (tokens · h · c) and, when lm_head trains, its fp32 weight gradient
    (vocab · h · 4). train.loss liger (liger-kernel 0.8.5): its own chunk, the tokens over
    ceil(vocab / h) rounded up to a power of two, holds one logits buffer in the compute
    dtype (c, its gradient written in place), plus the same kept gradients. `auto` counts
    the chunked version's buffers, the larger, since whether liger imports on the worker
    is not known here."""
    v, softcap = shape.vocab, bool(shape.logit_softcap)
    if not chunked_loss(shape, s):
        return float(tokens * (s.c + 12 + s.c * softcap) * v)
    if s.loss == "liger":
        per = -(-tokens // -(-v // shape.hidden))
        chunk = min(tokens, 1 << max(0, per - 1).bit_length())
        kept = tokens * shape.hidden * s.c + (4 * v * shape.hidden if s.adapter == "none" else 0)
        return float(chunk * v * s.c + kept)
    chunk = min(tokens, s.loss_chunk)
    per_entry = 4 + (s.c if s.mixed else 0) + 4 * softcap
    kept = tokens * shape.hidden * s.c + (4 * v * shape.hidden if s.adapter == "none" else 0)
    return float(chunk * v * per_entry + kept)


def _residual_bytes(s: Setup) -> int:
    if not s.gpu:
        return 4
    if s.strategy == "ddp" and s.adapter in ("none", "qlora"):
        return 4  # fp32 master weights under autocast (qlora: fp32 embeddings and norms)
    return s.c


def rank_memory(
    shape: ModelShape,
    s: Setup,
    gpu_model: str | None = None,
    ranks_per_node: int | None = None,
    calibration: Any = None,
) -> RankMemory:
    """One rank's peak. On GPUs `overhead` is the device lines for that GPU kind and node
    layout (trainer.planner.device: the default kind and 8 ranks a node when not given)."""
    m, n, c, o = shape.params, s.world, s.c, s.optim_bytes
    notes: list[str] = []
    held = 0.0
    if s.adapter != "none":
        w, g, opt, notes = _adapter_memory(shape, s)
        if s.strategy == "ddp":
            held = g / 2 if s.world > 1 else 0.0  # DDP's buckets for the adapter gradients
        elif s.strategy != "fsdp":
            held = g  # ZeRO's gradient partitions and reduce buckets
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
    overhead = 0.0 if s.gpu else CPU_RANK_OVERHEAD
    rank = RankMemory(
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
    if s.gpu:
        lines = device_lines(s, rank.total, gpu_model, ranks_per_node, calibration)
        rank.overhead, rank.device, rank.device_why = lines.total, lines.named(), lines.explain()
    return rank


def _model_parallel_memory(shape: ModelShape, s: Setup) -> tuple[float, float, float, list[str]]:
    """FSDP2 over dp of a (pp, tp) model-parallel share. Under pp the stage's weights stay
    gathered through the step (every microbatch in flight uses them) and its gradients
    accumulate unsharded until the last microbatch's backward."""
    c, o = s.c, s.optim_bytes
    share, layer, root = rank_params(shape, s)
    dp = max(1, s.world // (s.tp * s.pp))
    live = share if (s.pp > 1 or not s.fsdp_reshard) else root + 2 * layer
    weights = 4 * share / dp + c * live
    grads = 4 * share / dp + (c * share if s.pp > 1 else c * (root + layer))
    notes = [
        f"(dp {dp}, pp {s.pp}, tp {s.tp}): this rank holds {short_count(int(share))} parameters "
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


def _adapter_memory(shape: ModelShape, s: Setup) -> tuple[float, float, float, list[str]]:
    """Frozen base + trainable adapters. DDP replicates both; FSDP2 shards both over the
    ranks (the base in NF4 under QLoRA: 4-bit data, block scales and their factors, all
    sharded) and gathers one layer at a time; ZeRO-2 shards the adapters' gradients and
    optimizer state, ZeRO-3 the base and the adapters too."""
    m, c, n = shape.params, s.c, s.world
    lora = shape.lora_params(s.lora_r, list(s.lora_targets))
    quantized = shape.layers * shape.layer_linear_params
    widest = max(a * b for a, b in shape.linear_shapes().values())
    layer_lora = lora / max(shape.layers, 1)
    if s.strategy == "fsdp":
        if s.adapter == "qlora":
            layer = QLORA_BYTES_PER_PARAM * shape.layer_linear_params
            shards = QLORA_BYTES_PER_PARAM * quantized + c * (m - quantized)
            # NF4 dequantizes one weight at a time to the compute dtype for its matmul.
            gathered = 2 * layer + c * widest + c * shape.root_params
            notes = ["NF4 base (torchao), sharded; two layers gathered in flight"]
        else:
            shards = float(c * m)
            gathered = c * (2 * shape.layer_params + shape.root_params)
            notes = ["frozen base sharded; two layers gathered in flight"]
        weights = shards / n + gathered + 4.0 * lora / n + 4.0 * 2 * layer_lora
        grads = 4.0 * lora / n + 4.0 * layer_lora  # a layer's unsharded grads before reduce-scatter
        return weights, grads, float(s.optim_bytes * lora / n), notes
    if s.strategy in ("zero2", "zero3"):
        bucket = 2 * c * shape.hidden**2
        if s.strategy == "zero3":
            biggest = max(shape.layer_params, shape.embedding_params)
            weights = c * (m + lora) / n + c * 2 * biggest
            notes = ["frozen base and adapters partitioned; two modules gathered in flight"]
        else:
            weights = float(c * (m + lora))
            notes = ["frozen base replicated; adapter gradients and optimizer partitioned"]
        master = 4 if s.mixed else 0
        return weights, c * lora / n + bucket, float((master + s.optim_bytes) * lora / n), notes
    if s.adapter == "qlora":
        base = QLORA_BYTES_PER_PARAM * quantized + 4.0 * (m - quantized)
        # bitsandbytes dequantizes one weight at a time to the compute dtype for its matmul.
        base += c * widest
        notes = [
            "4-bit nf4 linears with double quantization; embeddings, lm_head and norms in "
            "fp32 (prepare_model_for_kbit_training)"
        ]
    else:
        base = float(c * m)
        notes = ["frozen base in the compute dtype"]
    weights = base + 4.0 * lora
    grads = 4.0 * lora * (2 if n > 1 else 1)
    return weights, grads, float(s.optim_bytes * lora), notes


def host_memory(shape: ModelShape, s: Setup, rank: RankMemory) -> HostMemory:
    """Host RAM per rank. A CPU rank's whole footprint is host RAM."""
    m, n, c, o = shape.params, s.world, s.c, s.optim_bytes
    staged = _staging_bytes(shape, s)
    if s.memory_tier:
        staged = {**staged, **_keeper_bytes(staged)}
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
    if s.adapter != "none" and s.strategy in ("fsdp", "zero3"):
        load = 0.0  # meta skeleton + mmapped weights, one tensor at a time; partitioned init
    elif s.adapter == "lora":
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


KEEPER_COPIES = 3
"""Snapshots of one share a keeper may hold at once (trainer.checkpoint.keeper): the
confirmed one, a newer complete one, and one arriving."""
SNAPSHOT_IN_TRANSIT = 2


def _keeper_bytes(staged: dict[str, float]) -> dict[str, float]:
    """The RAM tier's price per rank and per node (see HostMemory.keeper)."""
    share, rank0 = staged.get("staging", 0.0), staged.get("staging_rank0", 0.0)
    return {
        "keeper": (2 * KEEPER_COPIES + SNAPSHOT_IN_TRANSIT) * share,
        "keeper_node": 2 * KEEPER_COPIES * rank0 + SNAPSHOT_IN_TRANSIT * rank0,
    }


def _staging_bytes(shape: ModelShape, s: Setup) -> dict[str, float]:
    """The staging copy of one checkpoint (trainer.storage.staging): fp32 trainable weights and
    their optimizer state, in host RAM until the background write is done. FSDP stages
    each rank's shard (DCP async_save); DDP and adapters stage on rank 0 only; ZeRO-2/3
    stage each rank's optimizer partition (fp32 master + moments: what DeepSpeed's
    save_checkpoint hands its checkpoint engine), and under ZeRO-2 rank 0 also the module
    state dict in the compute dtype (ZeRO-3 saves placeholders there)."""
    if s.adapter != "none":
        lora = shape.lora_params(s.lora_r, list(s.lora_targets))
        if s.strategy == "ddp":
            return {"staging_rank0": float((4 + s.optim_bytes) * lora)}
        return {"staging": float((4 + s.optim_bytes) * lora / s.world)}  # each rank's share
    if s.strategy == "ddp":
        return {"staging_rank0": float((4 + s.optim_bytes) * shape.params)}
    if s.strategy == "fsdp":
        share, _, _ = rank_params(shape, s)
        dp = max(s.world // (s.tp * s.pp), 1)
        return {"staging": float((4 + s.optim_bytes) * share / dp)}
    partition = {"staging": float((4 + s.optim_bytes) * shape.params / s.world)}
    if s.strategy == "zero2":
        return {**partition, "staging_rank0": float(s.c * shape.params)}
    return partition


GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}
"""Bytes per parameter of each GGUF weight type (q8_0: blocks of 32 int8 and one fp16 scale)."""


def export_steps(shape: ModelShape, s: Setup) -> dict[str, float]:
    """Host RAM of each step of rank 0's export, which run one after another, each freeing
    what it held (trainer.checkpoint.export_check.finish_export):
    - write: the full fp32 model (FSDP's gathered state dict, DDP's safetensors
      serialisation), the 16-bit gather under DeepSpeed, or only the adapter (plus a fresh
      fp32 base and its serialisation when merging);
    - check merged: the check's reference, a second fp32 base with the adapter applied by
      PEFT (the merged folder is loaded only after it is freed: the same size again);
    - gguf <type>: gguf's writer holds every converted tensor until it writes the file;
    - check gguf: transformers reads the file back dequantized to an fp32 state dict and
      fills a model from it (two fp32 copies at the peak)."""
    m = shape.params
    adapter = 4.0 * shape.lora_params(s.lora_r, list(s.lora_targets)) if s.adapter != "none" else 0
    if s.adapter != "none":
        steps = {"write": adapter + (8.0 * m if s.merge_on_export else 0.0)}
        if s.merge_on_export:
            steps["check merged"] = 4.0 * m + adapter
    elif s.strategy in ("zero2", "zero3"):
        steps = {"write": float(s.c * m)}
    else:
        steps = {"write": 4.0 * m}
    for t in s.gguf_types:
        steps[f"gguf {t}"] = GGUF_BYTES[t] * m
        steps["check gguf"] = 8.0 * m
    return steps


def _export_bytes(shape: ModelShape, s: Setup) -> float:
    """The export phase's peak on rank 0's node: its largest step (export_steps)."""
    return max(export_steps(shape, s).values())
