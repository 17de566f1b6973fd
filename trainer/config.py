"""The one job config: loaded from YAML, validated once, passed as-is to every worker.

This module is pure (pydantic + PyYAML only) so `tools/` can validate a job on a laptop
without torch or Ray. Checks that need the model's own config.json or the data files live
in `trainer.preflight`, which runs on the client and again on the cluster before workers
are started.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "deepspeed")
"""Strategies this build of the trainer implements; `trainer.strategies.base` registers them."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class _Section(BaseModel):
    """Every section rejects unknown keys: a typo must not silently become a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSection(_Section):
    r: int = Field(default=8, ge=1, description="Adapter rank.")
    alpha: float = Field(default=16.0, gt=0, description="Scale; the update is alpha/r × BA.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["auto", "all-linear"] = Field(
        default="auto",
        description="Module names that get adapters. auto: peft's default for the model's "
        "architecture where it has one, else every linear of the attention and MLP blocks "
        "(docs/models.md lists each family's); all-linear: every such linear.",
    )
    merge_on_export: bool = Field(
        default=False,
        description="Also export the base model with the adapter merged in (model_merged/).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list; give module names, or auto")
        return value


class ModelSection(_Section):
    path: str = Field(description="HF model folder: local dir, shared-FS dir, or s3:// URI.")
    tokenizer: str | None = Field(
        default=None, description="Tokenizer folder; defaults to the model folder."
    )
    special_tokens: str | None = Field(
        default=None,
        description='JSON file {"tokens": [...]} added to the tokenizer; embeddings resized.',
    )
    # flash_attention_2 is not offered: the GPU image's lock has no flash-attn package, and
    # a setting that can only fail on the cluster is worse than no setting. sdpa already
    # dispatches to a flash kernel on GPUs that have one (trainer.model.families).
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        default="auto",
        description="auto: sdpa where the model supports it in the pinned transformers, "
        "else eager (Gemma 2), resolved at preflight and printed in the plan. sdpa uses "
        "PyTorch's fused (flash) kernels where available; a model that cannot run it is "
        "refused at preflight.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward: less memory, ~30% slower."
    )
    adapter: Literal["none", "lora", "qlora"] = Field(
        default="none",
        description="none: train every weight. lora: train low-rank adapters on a frozen base "
        "loaded in the compute dtype. qlora: the same over a 4-bit nf4 base (bitsandbytes with "
        "ddp, torchao's NF4 sharded with fsdp).",
    )
    lora: LoraSection = Field(
        default_factory=LoraSection, description="Adapter options (lora/qlora)."
    )


class SourceSpec(_Section):
    """One corpus of a mix: its files, its share of the blocks, and its name in metrics."""

    path: str = Field(description="A file, folder, glob or s3:// prefix (as data.train_file).")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the blocks drawn.")
    name: str | None = Field(
        default=None, description="Name in metrics (tokens_seen/<name>, eval_loss/<name>)."
    )


def _source_name(spec: SourceSpec) -> str:
    if spec.name:
        return spec.name
    for part in reversed(spec.path.rstrip("/").split("/")):
        name = re.sub(r"(\.jsonl|\.gz|\.zst|\.parquet)+$", "", part)
        if name and not any(c in name for c in "*?["):
            return name
    return "data"


def _spec(value: str | SourceSpec) -> SourceSpec:
    return SourceSpec(path=value) if isinstance(value, str) else value


class DataSection(_Section):
    train_file: str | list[str | SourceSpec] = Field(
        description="A file, folder, glob or s3:// prefix of .jsonl, .jsonl.gz, .jsonl.zst or "
        '.parquet files; rows are {"text"} / {"input"}, {"prompt", "completion"} or '
        '{"messages": [{"role", "content"}, ...]}. Files are read in sorted path order. '
        "Or a list of such sources, each a path or {path, weight, name}: every block of a "
        "global batch is drawn from source i with probability weight_i / sum of weights."
    )
    eval_file: str | list[str | SourceSpec] | None = Field(
        default=None,
        description="The same kinds of input, for eval loss/perplexity; a list gives an "
        "eval_loss/<name> per source besides the overall eval_loss.",
    )
    block_size: int = Field(default=1024, gt=1, description="Tokens per packed sequence.")
    on_bad_line: Literal["error", "skip"] = Field(
        default="error",
        description="error: stop at the first malformed row (file:line, or file:row N for "
        "parquet). skip: skip it, count it, and report the count and first rows.",
    )
    append_eos: bool = Field(
        default=True, description="End every document with EOS (kept in the loss)."
    )
    loss_on: Literal["all", "completion"] = Field(
        default="completion",
        description="completion: prompt/completion and chat rows are trained on the completion "
        "and assistant tokens only (text rows: every token). all: every token of every row.",
    )
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template (a file path or the text) for prompt/completion and "
        "chat rows; null = the tokenizer's own.",
    )

    @field_validator("train_file", "eval_file")
    @classmethod
    def _sources_named_once(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list of sources; give at least one path")
            names = [_source_name(_spec(v)) for v in value]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"sources named {', '.join(twice)} more than once; give each a unique name"
                )
        return value

    def sources(self, which: str = "train") -> list[SourceSpec]:
        """The train (or eval) sources, each with its name: a single path is one source."""
        value = self.train_file if which == "train" else self.eval_file
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        return [_spec(v).model_copy(update={"name": _source_name(_spec(v))}) for v in items]

    long_rows: Literal["split", "drop"] = Field(
        default="split",
        description="Rows longer than block_size: split across blocks, or drop them; the count "
        "is reported either way.",
    )
    attention: Literal["auto", "document", "causal"] = Field(
        default="auto",
        description="document: a token attends only to earlier tokens of its own row, and "
        "positions restart per row (a block-causal mask: packed rows stay independent). "
        "causal: every earlier token of the packed block. auto: document when the data has "
        "chat or prompt/completion rows, causal for plain text (and under strategy.pp > 1).",
    )
    tokenize_on: Literal["auto", "driver", "cluster"] = Field(
        default="auto",
        description="cluster: Ray Data tasks on every node's CPUs, one per input file. driver: "
        "one process where the job starts. auto: cluster for several files on a Ray cluster.",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Where tokenized caches go (a shared-FS folder every node mounts); default "
        "is next to local data. Required for s3:// data.",
    )


class OptimSection(_Section):
    name: Literal["adamw", "adamw8bit"] = Field(
        default="adamw",
        description="adamw8bit: bitsandbytes 8-bit AdamW states (about 1/4 the memory).",
    )
    lr: float = Field(default=3e-4, gt=0, description="Peak learning rate (AdamW).")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="After warmup: cosine to min_lr_ratio, linear to 0, or flat."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Floor of cosine/linear.")
    weight_decay: float = Field(
        default=0.0, ge=0, description="On matrices only; not on biases and norms."
    )
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float | None = Field(default=1.0, gt=0, description="Max grad norm; null = off.")


class DDPOptions(_Section):
    """Every rank holds the whole model; gradients are all-reduced."""

    name: Literal["ddp"] = Field(default="ddp", description="Data parallel: whole model per rank.")


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


StrategyOptions = Annotated[
    DDPOptions | FSDPOptions | DeepSpeedOptions, Field(discriminator="name")
]


OBJECTIVES = ("sft", "dpo", "ipo", "hinge", "simpo", "orpo")
"""Training objectives (trainer.objectives): what a batch is and how its loss is made."""

PREFERENCE_BETA = {"dpo": 0.1, "ipo": 0.1, "hinge": 0.1, "simpo": 2.0, "orpo": 0.1}
"""beta when train.preference.beta is unset: TRL's DPOConfig (0.1; for IPO its tau) and
ORPOConfig (lambda, 0.1), the SimPO paper's 2.0."""


class PreferenceSection(_Section):
    beta: float | None = Field(
        default=None,
        gt=0,
        description="dpo/hinge: the KL strength; ipo: the regularisation tau; simpo: the "
        "reward scale; orpo: lambda, the odds-ratio weight. null: 0.1 (dpo, ipo, hinge, "
        "orpo: TRL's defaults), 2.0 (simpo: the SimPO paper's).",
    )
    simpo_gamma: float = Field(
        default=1.0,
        ge=0,
        description="simpo: the target reward margin gamma (the paper's gamma/beta = 0.5 "
        "with beta 2.0).",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="dpo and simpo: the probability that a pair's labels are flipped "
        "(conservative DPO); 0 is the plain loss.",
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="A pair longer than data.block_size first loses prompt tokens from the "
        "left down to this many (default: half of block_size), then both completions are cut "
        "on the right to fit. Chosen and rejected always keep the same prompt.",
    )

    def beta_for(self, objective: str) -> float:
        return self.beta if self.beta is not None else PREFERENCE_BETA[objective]


class TrainSection(_Section):
    objective: Literal["sft", "dpo", "ipo", "hinge", "simpo", "orpo"] = Field(
        default="sft",
        description="sft: next-token loss on the data's targets. dpo, ipo, hinge: preference "
        "losses against a reference (the base with the adapter off under lora/qlora, else "
        "log-probs precomputed before step 1); simpo, orpo: preference losses without a "
        "reference. Preference data are prompt/chosen/rejected rows (docs: preference).",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection,
        description="Options of the preference objectives.",
    )
    micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="Sequences per worker per micro step (pairs, each two sequences, for a "
        "preference objective).",
    )
    grad_accum: int = Field(default=1, ge=1, description="Micro steps per optimizer step.")
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per optimizer step over all workers. If set, grad_accum is "
        "derived from it and must divide evenly.",
    )
    epochs: float | None = Field(
        default=1, gt=0, description="Passes over the data (fractions ok)."
    )
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs if set.")
    stop_at_step: int | None = Field(
        default=None,
        ge=1,
        description="End this submission after this step (the schedule still spans the "
        "whole run); resubmit with the same run name to continue.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="Compute dtype; bf16/fp16 autocast over fp32 master weights (GPU).",
    )
    seed: int = Field(default=42, description="Seeds init, data order and RNG streams.")
    eval_every: int | None = Field(default=None, ge=1, description="Steps between evals.")
    eval_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Blocks each eval reads: the first N of the eval set, the same blocks for "
        "any world size, layout, grad_accum or elastic size; null = the whole eval set.",
    )
    eval_batches: int | None = Field(
        default=None,
        ge=1,
        description="Older form of eval_blocks: eval_batches × micro_batch_size blocks for the "
        "whole run (it used to count per worker, so the eval set changed with the layout).",
    )

    @property
    def eval_limit(self) -> int | None:
        """Blocks each eval reads: eval_blocks, else eval_batches × micro_batch_size."""
        if self.eval_blocks is not None:
            return self.eval_blocks
        if self.eval_batches is not None:
            return self.eval_batches * self.micro_batch_size
        return None

    log_every: int = Field(default=1, ge=1, description="Steps between metric reports.")
    as_test: bool = Field(
        default=False, description="One forward/backward and one step, then exit (smoke test)."
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (ddp, fsdp). Needs a C compiler on "
        "every node (inductor builds its kernels there); the first steps are slower while "
        "it compiles. Off by default: on CPU it did not pay (docs: strategies, benchmarks).",
    )
    loss: Literal["auto", "chunked", "liger", "plain"] = Field(
        default="auto",
        description="The causal-LM loss: chunked never holds a batch's whole logits (Raylift's "
        "torch version); liger = liger-kernel's fused linear cross-entropy (GPUs only); auto "
        "= liger on GPUs where it is installed, else chunked, for the families it was "
        "checked on (pp and tp included), plain (the model's own) otherwise (docs: strategies).",
    )
    loss_chunk: int = Field(default=1024, ge=1, description="Tokens per chunk of the chunked loss.")


class ScalingSection(_Section):
    num_workers: int | tuple[int, int] = Field(
        default=2,
        description="Ray Train workers (one per GPU), or [min, max] for elastic training: "
        "the run goes on with fewer workers after losing nodes and grows back when they "
        "return; the global batch stays that of max workers (grad_accum adapts).",
    )
    elastic_resize_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="Elastic runs: seconds between checks for returned capacity to grow into.",
    )
    use_gpu: bool = Field(
        default=False, description="One GPU per worker unless resources say more."
    )
    resources_per_worker: dict[str, float] | None = Field(
        default=None, description='Ray resources per worker, e.g. {"CPU": 8, "GPU": 1}.'
    )
    backend: Literal["auto", "gloo", "nccl", "ccl"] = Field(
        default="auto", description="auto: nccl with GPUs, gloo without."
    )
    rank0_label: dict[str, str] | None = Field(
        default_factory=lambda: {"large_cpu_mem": "true"},
        description="Put rank 0 on a node with these labels when the cluster has one.",
    )
    expandable_segments: bool = Field(
        default=True,
        description="GPU workers: PyTorch's allocator grows one segment per stream instead "
        "of caching fixed ones (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set unless "
        "you set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF yourself), which removes most "
        "fragmentation; the planner's allocator slack follows it. Turn off with CUDA graphs, "
        "NCCL user-buffer registration or CUDA IPC sharing of tensors (docs: planning).",
    )

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(v, tuple):
            lo, hi = v
            if not 1 <= lo <= hi:
                raise ValueError(f"[min, max] needs 1 <= min <= max, got [{lo}, {hi}]")
            return lo if lo == hi else (lo, hi)
        if v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers


class CheckpointSection(_Section):
    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description="Steps between resume checkpoints in storage. auto: chosen by the run "
        "from the measured save cost and the failures storage must cover, and chosen again "
        "as they move (docs/checkpoints.md); null = only at the end.",
    )
    max_overhead: float = Field(
        default=0.02,
        gt=0,
        lt=1,
        description="With auto intervals, the share of training time a tier's checkpoints may "
        "stall it: a measured stall above it lengthens that tier's interval.",
    )
    failure_rate_per_hour: float | None = Field(
        default=None,
        gt=0,
        description="With auto intervals, hard failures per hour of the whole job (worker "
        "kills, nodes lost without notice) that the cadence starts from, instead of the "
        "prior (the pool's spot band and the hardware rate). For fault drills and "
        "benchmarks whose faults come at a known rate; null = the prior.",
    )
    max_interval_s: float | None = Field(
        default=1800.0,
        gt=0,
        description="With auto intervals, the longest a tier's interval may run, in seconds "
        "of training (the storage interval, and so the RAM tier's, of which it is a "
        "multiple): a fault the failure-rate priors did not expect then loses at most this "
        "much of the cluster's work; at the default a 5 s storage save stalls 0.3 % of the "
        "time. Wins over max_overhead, never over the write floor. null = no cap.",
    )
    keep_last: int = Field(default=3, ge=1, description="Complete checkpoints kept; older pruned.")
    export_every: int | None = Field(
        default=None,
        ge=1,
        description="Steps between Hugging Face exports (export/step_<N>/); the end of the run "
        "always exports. null = only at the end.",
    )
    allow_restart_from_scratch: bool = Field(
        default=False,
        description="If the run folder holds only torn checkpoints, train from step 0 "
        "(with a warning) instead of stopping with an error that names them.",
    )
    upload: Literal["async", "sync"] = Field(
        default="async",
        description="async: training goes on while a checkpoint uploads (Ray Train); a "
        "checkpoint counts only once its upload completed and verified. sync: wait.",
    )
    max_uploads_in_flight: int = Field(
        default=1,
        ge=1,
        description="Async uploads queued or running at once; a checkpoint due beyond it waits.",
    )
    background_idle: bool = Field(
        default=True,
        description="The threads that write and upload checkpoints in the background (and "
        "the transfer threads they start) run under Linux's SCHED_IDLE policy: they get a "
        "core only when training leaves one idle, and never preempt it. false: only "
        "background_nice lowers them.",
    )
    background_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Nice value of the threads that write and upload checkpoints in the "
        "background (and the transfer threads they start), so they take the CPU only when "
        "training leaves it idle; 0 keeps training's priority.",
    )
    stuck_write_s: float = Field(
        default=600.0,
        ge=0,
        description="A background checkpoint write that adds no byte to its folder for "
        "this long counts as hung (a stuck file system, a save waiting on a lost peer): "
        "the attempt fails with an error naming the step, and the run restarts from the "
        "last complete checkpoint instead of idling. 0: wait forever.",
    )
    upload_retry_s: float = Field(
        default=300.0,
        ge=0,
        description="How long an upload retries transient storage errors (throttling, a "
        "server briefly down) with backoff before the attempt fails.",
    )
    memory_every: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="Steps between snapshots of the resume state to the RAM tier: keepers "
        "(one Ray actor per node) hold the newest complete snapshot in host memory, each "
        "copied to a buddy keeper on another node, so a hard kill (a SIGKILLed worker, an "
        "OOM kill, a node lost without notice) restores from memory and loses at most a "
        "step or two instead of a checkpoint interval. 0 = off. auto (the default): on, "
        "at the interval the run chooses from the measured snapshot cost and the rate of "
        "hard kills, for Ray Train runs with DDP, FSDP and adapters; off with DeepSpeed "
        "(a number there is refused at preflight) and under torchrun.",
    )

    @property
    def memory_tier(self) -> bool:
        """Whether the RAM tier may be on (a number > 0, or auto); the runtime and the
        strategy decide the rest (trainer.checkpoint.cadence.memory_tier_on)."""
        return self.memory_every == "auto" or self.memory_every > 0


class StorageSection(_Section):
    path: str = Field(
        default="./runs", description="Local dir, shared-FS dir, or s3://bucket/prefix."
    )
    endpoint_override: str | None = Field(
        default=None, description="S3-compatible endpoint, e.g. http://127.0.0.1:8333."
    )
    region: str | None = Field(default=None, description="S3 region (else AWS_REGION).")

    @property
    def is_s3(self) -> bool:
        return self.path.startswith("s3://")


class RunSection(_Section):
    name: str = Field(description="Run name; same name + storage = resume.")
    max_failures: int = Field(
        default=3, ge=-1, description="Worker-group restarts allowed; -1 = forever."
    )
    max_preemptions: int = Field(
        default=-1,
        ge=-1,
        description="Restarts after spot preemptions (counted apart from failures); -1 = forever.",
    )


class MlflowTracking(_Section):
    tracking_uri: str = Field(
        description="MLflow tracking server (http://host:5000) or store URI (sqlite:///path.db); "
        "credentials come from MLFLOW_TRACKING_TOKEN / _USERNAME / _PASSWORD (submit --env)."
    )
    experiment: str = Field(
        default="raylift", description="Experiment the run goes into (created if missing)."
    )


class WandbTracking(_Section):
    project: str = Field(description="W&B project.")
    entity: str | None = Field(default=None, description="W&B team or user; null = yours.")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: write run files only (copied to <run>/wandb/; `wandb sync` "
        "them later). online needs WANDB_API_KEY in the job's env (submit --env).",
    )


class TensorBoardTracking(_Section):
    dir: str | None = Field(
        default=None,
        description="Event-file folder; null = <storage>/<run>/tensorboard (survives the "
        "cluster; S3 runs are uploaded at each checkpoint and at the end).",
    )


class TrackingSection(_Section):
    """Experiment trackers; any combination. Only rank 0 talks to them, from background
    threads: a tracker that is down or slow never stops training."""

    mlflow: MlflowTracking | None = Field(default=None, description="Log to MLflow.")
    wandb: WandbTracking | None = Field(default=None, description="Log to Weights & Biases.")
    tensorboard: TensorBoardTracking | None = Field(
        default=None, description="Write TensorBoard event files (`tensorboard: {}` is enough)."
    )
    per_rank_every: int = Field(
        default=10,
        ge=1,
        description="Logged steps between records of every rank's memory and step times "
        "(every logged step has their min/mean/max and the max's rank).",
    )
    buffer: int = Field(
        default=100_000,
        ge=100,
        description="Points a tracker may hold while it is unreachable; older ones are dropped "
        "from it (never from metrics.jsonl) and counted at the end.",
    )
    ray_metrics: bool = Field(
        default=True,
        description="Export per-worker memory and step times as Ray metrics (dashboard, "
        "Prometheus scrape of the cluster).",
    )
    close_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="At the end of an attempt, seconds the trackers get for their last sends "
        "(a failed attempt gets at most 10); what is still unsent then is counted, and the "
        "next attempt resends it from metrics.jsonl.",
    )

    @field_validator("tensorboard", mode="before")
    @classmethod
    def _tensorboard_shorthand(cls, v: Any) -> Any:
        """`tensorboard: true` means the default folder; `false` means off."""
        if isinstance(v, bool):
            return {} if v else None
        return v

    @property
    def trackers(self) -> list[str]:
        return [n for n in ("mlflow", "wandb", "tensorboard") if getattr(self, n) is not None]


class JobConfig(_Section):
    model: ModelSection
    data: DataSection
    strategy: StrategyOptions = Field(default_factory=DDPOptions)
    train: TrainSection = Field(default_factory=TrainSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    run: RunSection
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="before")
    @classmethod
    def _strategy_shorthand(cls, data: Any) -> Any:
        """`strategy: fsdp` means `strategy: {name: fsdp}`; an unknown name is one line."""
        if not isinstance(data, dict):
            return data
        train = data.get("train")
        if isinstance(train, dict) and "strategy" in train:
            raise ValueError(
                "train.strategy moved to its own section: write `strategy: {name: "
                f"{train['strategy']}}}` (options per strategy: see the config reference)"
            )
        strat = data.get("strategy")
        if isinstance(strat, str):
            strat = {"name": strat}
            data = {**data, "strategy": strat}
        if isinstance(strat, dict) and strat.get("name", "ddp") not in STRATEGIES:
            raise ValueError(
                f"strategy.name: {strat['name']!r} is not available; choose one of "
                f"{', '.join(STRATEGIES)}"
            )
        return data

    def _check_adapter(self) -> None:
        """Adapters compose with every strategy, within these limits (each one line)."""
        adapter, s = self.model.adapter, self.strategy
        if isinstance(s, FSDPOptions):
            if s.tp > 1 or s.pp > 1:
                raise ValueError(
                    f"model.adapter: {adapter} with strategy.tp/pp > 1 is not supported in "
                    "this build (adapters shard over FSDP2's data-parallel dim only); "
                    "use tp = pp = 1"
                )
            if adapter == "qlora" and s.cpu_offload:
                raise ValueError(
                    "strategy.cpu_offload: not supported with model.adapter qlora (the NF4 "
                    "base is already 4-bit and sharded); set cpu_offload false"
                )
        if s.name == "deepspeed" and adapter == "qlora":
            raise ValueError(
                "model.adapter: qlora is not supported with strategy deepspeed (ZeRO "
                "cannot partition a 4-bit base); use strategy fsdp (NF4 base, sharded) or "
                "adapter lora"
            )

    def _check_preference(self) -> None:
        """What a preference objective cannot do in this build, each refused in one line."""
        objective, s = self.train.objective, self.strategy
        if isinstance(s, FSDPOptions) and (s.tp > 1 or s.pp > 1):
            raise ValueError(
                f"train.objective: {objective} with strategy.tp/pp > 1 is not supported in this "
                "build (its sequence log-probs need whole-vocabulary logits on one rank); use "
                "tp = pp = 1"
            )
        if isinstance(self.data.train_file, list):
            raise ValueError(
                f"data.train_file: a list of sources with train.objective {objective} is not "
                "supported in this build; give one file, folder or glob of preference rows"
            )
        if self.data.eval_file is not None:
            raise ValueError(
                f"data.eval_file: not supported with train.objective {objective} in this build "
                "(eval_loss is a next-token loss); leave it unset"
            )
        if self.data.attention == "document":
            raise ValueError(
                f"data.attention: document does not apply to train.objective {objective} "
                "(pairs are never packed: each sequence is a block of its own); leave it auto"
            )

    @model_validator(mode="after")
    def _combinations(self) -> JobConfig:
        t, s = self.train, self.scaling
        if isinstance(self.strategy, FSDPOptions):
            if self.strategy.cpu_offload and not s.use_gpu:
                raise ValueError(
                    "strategy.cpu_offload: needs GPUs (on CPU the shards already live in RAM)"
                )
            if t.precision == "fp16":
                raise ValueError("train.precision: fp16 is not supported with fsdp; use bf16")
            self._check_parallel(self.strategy)
        if self.strategy.name == "deepspeed" and self.optim.name == "adamw8bit":
            raise ValueError(
                "optim.name: adamw8bit is not available with strategy deepspeed (DeepSpeed's "
                "ZeRO optimizer owns the optimizer states); use adamw, or ddp/fsdp for 8-bit"
            )
        if (
            self.data.attention == "document"
            and isinstance(self.strategy, FSDPOptions)
            and self.strategy.pp > 1
        ):
            raise ValueError(
                "data.attention: document is not supported with strategy.pp > 1 in this build "
                "(pipeline stages build their own causal mask); use causal or pp = 1"
            )
        if self.model.adapter != "none":
            self._check_adapter()
        if t.objective != "sft":
            self._check_preference()
        if t.global_batch_size is not None:
            per_step = t.micro_batch_size * self.data_parallel
            if t.global_batch_size % per_step:
                replicas = "num_workers" if self.model_parallel == 1 else "(workers / tp × pp)"
                raise ValueError(
                    f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                    f"micro_batch_size × {replicas} = {t.micro_batch_size} × "
                    f"{self.data_parallel} = {per_step}"
                )
            derived = t.global_batch_size // per_step
            if t.grad_accum not in (1, derived):
                raise ValueError(
                    f"train.grad_accum: {t.grad_accum} contradicts global_batch_size "
                    f"{t.global_batch_size} (which implies {derived}); set only one"
                )
            object.__setattr__(t, "grad_accum", derived)
        if t.compile and self.strategy.name == "deepspeed":
            raise ValueError(
                "train.compile: not supported with strategy deepspeed in this build (its "
                "engine wraps the model; use ddp or fsdp, or leave compile off)"
            )
        if s.elastic and self.strategy.name == "deepspeed":
            raise ValueError(
                "scaling.num_workers: [min, max] (elastic) needs strategy ddp or fsdp; "
                "DeepSpeed resumes its checkpoint only on the world size that wrote it"
            )
        if s.elastic:
            gb = t.micro_batch_size * t.grad_accum * s.max_workers
            bad = [
                w for w in range(s.min_workers, s.max_workers + 1) if gb % (t.micro_batch_size * w)
            ]
            if bad:
                raise ValueError(
                    f"scaling.num_workers: the global batch {gb} cannot be kept on "
                    f"{', '.join(map(str, bad))} worker(s) (not divisible by micro_batch_size "
                    f"{t.micro_batch_size} × workers); pick [min, max] whose sizes divide it"
                )
        if t.epochs is None and t.max_steps is None:
            raise ValueError("train: set epochs or max_steps")
        if t.max_steps is not None and t.stop_at_step is not None and t.stop_at_step > t.max_steps:
            raise ValueError(
                f"train.stop_at_step: {t.stop_at_step} is past max_steps {t.max_steps}"
            )
        if t.max_steps is not None and self.optim.warmup_steps >= t.max_steps > 1:
            raise ValueError(
                f"optim.warmup_steps: {self.optim.warmup_steps} leaves no steps after warmup "
                f"(max_steps is {t.max_steps})"
            )
        if t.precision != "fp32" and not s.use_gpu:
            raise ValueError(
                f"train.precision: {t.precision} needs GPUs (scaling.use_gpu: true); "
                "use fp32 for CPU training"
            )
        if t.loss == "liger" and not s.use_gpu:
            raise ValueError(
                "train.loss: liger runs liger-kernel's Triton kernel on GPUs only (scaling."
                "use_gpu: true); use auto or chunked for CPU training"
            )
        if s.backend == "nccl" and not s.use_gpu:
            raise ValueError("scaling.backend: nccl needs scaling.use_gpu: true; use gloo or ccl")
        if s.resources_per_worker and s.use_gpu and s.resources_per_worker.get("GPU", 1) <= 0:
            raise ValueError("scaling.resources_per_worker.GPU must be > 0 when use_gpu is true")
        if not _RUN_NAME.match(self.run.name):
            raise ValueError(
                f"run.name: {self.run.name!r} must be 1-128 of letters, digits, '.', '_', '-' "
                "(it becomes a storage path)"
            )
        if self.storage.endpoint_override and not (self.storage.is_s3 or self._s3_data):
            raise ValueError("storage.endpoint_override is only meaningful for an s3:// path")
        if self._s3_data and not self.data.cache_dir:
            raise ValueError(
                "data.cache_dir: required for s3:// data (a shared-FS folder every node "
                "mounts, where the tokenized shards are written)"
            )
        return self

    def _check_parallel(self, st: FSDPOptions) -> None:
        """The (dp, pp, tp) layout checks that need only the config; the ones that need
        the model's config.json live in trainer.parallel.layout (run by the preflight)."""
        t, s = self.train, self.scaling
        if st.model_parallel == 1:
            if st.microbatches is not None or st.pp_schedule != "1f1b":
                raise ValueError(
                    "strategy.microbatches / strategy.pp_schedule: only meaningful with "
                    "strategy.pp > 1; set pp or remove them"
                )
            return
        if s.elastic:
            raise ValueError(
                f"scaling.num_workers: [min, max] (elastic) needs strategy.tp = strategy.pp "
                f"= 1 (a {st.tp}×{st.pp} model-parallel group cannot lose a member); use a "
                "fixed num_workers"
            )
        if s.max_workers % st.model_parallel:
            raise ValueError(
                f"scaling.num_workers: {s.max_workers} workers do not divide into groups of "
                f"tp × pp = {st.tp} × {st.pp} = {st.model_parallel}; use a multiple of "
                f"{st.model_parallel}"
            )
        if st.cpu_offload:
            raise ValueError(
                "strategy.cpu_offload: not supported with tp or pp > 1 in this build; "
                "turn it off or use tp = pp = 1"
            )
        if st.pp == 1:
            if st.microbatches is not None or st.pp_schedule != "1f1b":
                raise ValueError(
                    "strategy.microbatches / strategy.pp_schedule: only meaningful with "
                    "strategy.pp > 1; set pp or remove them"
                )
            return
        m = st.n_microbatches
        if t.micro_batch_size % m:
            raise ValueError(
                f"strategy.microbatches: {m} does not divide train.micro_batch_size "
                f"{t.micro_batch_size} (every pipeline microbatch needs the same number of "
                "rows); pick a divisor or raise micro_batch_size"
            )
        if st.stages_per_rank > 1 and m % st.pp:
            raise ValueError(
                f"strategy.microbatches: {st.pp_schedule} needs a multiple of pp = {st.pp}, got {m}"
            )
        if m < st.pp:
            raise ValueError(
                f"strategy.microbatches: {m} is fewer than pp = {st.pp} stages (the pipeline "
                f"would never fill); use at least {st.pp}"
            )

    @property
    def data_parallel(self) -> int:
        """Model replicas that read different data: workers / (tp × pp)."""
        return self.scaling.max_workers // self.model_parallel

    @property
    def model_parallel(self) -> int:
        st = self.strategy
        return st.model_parallel if isinstance(st, FSDPOptions) else 1

    def data_rank(self, rank: int, world_size: int) -> tuple[int, int]:
        """(replica index, replicas) of a worker: the mesh is (dp, pp, tp) in row-major
        order, so the workers of one model-parallel group are consecutive ranks and share
        a batch."""
        mp = self.model_parallel
        return rank // mp, world_size // mp

    @property
    def _s3_data(self) -> bool:
        specs = self.data.sources("train") + self.data.sources("eval")
        return any(s.path.startswith("s3://") for s in specs)

    # Derived values every part of the trainer agrees on.
    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step across all workers."""
        return self.train.micro_batch_size * self.train.grad_accum * self.data_parallel

    def grad_accum_for(self, world_size: int) -> int:
        """Micro steps per optimizer step on `world_size` workers that keep the global
        batch (an elastic run that lost workers accumulates more)."""
        replicas = world_size // self.model_parallel
        return self.global_batch // (self.train.micro_batch_size * replicas)

    @property
    def sequences_per_example(self) -> int:
        """Sequences one batch item holds: a preference pair is two (chosen, rejected)."""
        return 1 if self.train.objective == "sft" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.sequences_per_example * self.data.block_size

    @property
    def backend(self) -> str:
        if self.scaling.backend != "auto":
            return self.scaling.backend
        return "nccl" if self.scaling.use_gpu else "gloo"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------- loading and overrides


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, for error messages."""


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    sub = (*path, str(key.value))
                    lines[sub] = key.start_mark.line + 1
                    walk(value, sub)

    try:
        root = yaml.compose(text, Loader=_LineLoader)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` → (["train", "lr"], 0.0001). Values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r}: expected section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_errors(exc: ValidationError, source: str, lines: dict[tuple[str, ...], int]) -> str:
    out = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        tag = ""
        if len(loc) > 1 and loc[0] == "strategy" and loc[1] in STRATEGIES:
            tag, loc = loc[1], (loc[0], *loc[2:])  # the union's tag is not a config key
        field = ".".join(loc) if loc else "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/config-reference.md)"
            if tag:
                msg = f"unknown key for strategy {tag} (see docs/config-reference.md)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r})"
        where = source
        probe = loc
        while probe and probe not in lines:
            probe = probe[:-1]
        if probe:
            where = f"{source}:{lines[probe]}"
        if msg.startswith(field + ":") or (not loc and ":" in msg.split(" ")[0]):
            out.append(f"{where}: {msg}")
        else:
            out.append(f"{where}: {field}: {msg}")
    return "\n".join(out)


def load_config(
    source: str | Path | dict[str, Any], overrides: list[str] | None = None
) -> JobConfig:
    """Load, override and validate a job config; raises ConfigError with every problem found."""
    overrides = overrides or []
    if isinstance(source, dict):
        data, name, text = json.loads(json.dumps(source)), "<config>", ""
    else:
        path = Path(source)
        name = str(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections")
    data = apply_overrides(data, overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, name, _key_lines(text))) from None
