"""The whole job: every section, the checks that span sections, and the values derived from
more than one (the global batch, data-parallel replicas, tokens per step)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import Field, model_validator

from trainer.config.base import _RUN_NAME, STRATEGIES, _Section
from trainer.config.checkpoint import CheckpointSection, StorageSection
from trainer.config.data import DataSection
from trainer.config.export import ExportSection
from trainer.config.model import ModelSection
from trainer.config.rl import RL_OBJECTIVES
from trainer.config.run import RunSection, TrackingSection
from trainer.config.scaling import ScalingSection
from trainer.config.strategy import DDPOptions, FSDPOptions, StrategyOptions
from trainer.config.train import OptimSection, TrainSection


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
    export: ExportSection = Field(default_factory=ExportSection)

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

    def _check_gguf(self) -> None:
        """GGUF is made from one whole HF folder on rank 0: the full model or the merged one."""
        if self.model.adapter != "none" and not self.model.lora.merge_on_export:
            raise ValueError(
                f"export.formats: gguf needs the whole model, and model.adapter "
                f"{self.model.adapter} exports only the adapter; set "
                "model.lora.merge_on_export: true"
            )
        if isinstance(self.strategy, FSDPOptions) and self.strategy.pp > 1:
            raise ValueError(
                "export.formats: gguf with strategy.pp > 1 is not supported in this build (each "
                "stage writes its own part of the HF folder); drop gguf or use pp = 1"
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

    def _check_rl(self) -> None:
        """What an online RL objective cannot do in this build, each refused in one line;
        the global batch (completions per step) holds whole groups, as TRL requires."""
        objective, s, rl = self.train.objective, self.strategy, self.train.rl
        if isinstance(s, FSDPOptions) and (s.tp > 1 or s.pp > 1):
            raise ValueError(
                f"train.objective: {objective} with strategy.tp/pp > 1 is not supported in this "
                "build (generate needs whole layers on every rank); use tp = pp = 1"
            )
        if self.data.attention == "document":
            raise ValueError(
                f"data.attention: document does not apply to train.objective {objective} "
                "(completions are never packed: each is a row of its own); leave it auto"
            )
        if isinstance(self.data.train_file, list):
            raise ValueError(
                f"data.train_file: a list of sources with train.objective {objective} is not "
                "supported in this build; give one file, folder or glob of prompt rows"
            )
        if self.scaling.elastic:
            raise ValueError(
                f"scaling.num_workers: [min, max] (elastic) is not supported with "
                f"train.objective {objective} in this build (each worker samples whole groups "
                "of a fixed share); give one number"
            )
        if self.data.eval_file is not None:
            raise ValueError(
                f"data.eval_file: not supported with train.objective {objective} in this build "
                "(eval_loss is a next-token loss); leave it unset"
            )
        if not rl.rewards:
            raise ValueError(
                f"train.rl.rewards: train.objective {objective} needs at least one reward, e.g. "
                "[{function: rewards.py:my_reward}] or [{function: math_answer}]"
            )
        if objective == "rloo" and rl.loss_type != "dapo":
            raise ValueError(
                f"train.rl.loss_type: {rl.loss_type} does not apply to rloo (its loss is one "
                "clipped term per completion); remove it or use objective grpo"
            )
        per_step = self.train.micro_batch_size * self.data_parallel
        gb = self.train.global_batch_size or per_step * self.train.grad_accum
        whole = rl.num_generations * self.data_parallel
        if gb % whole:
            raise ValueError(
                f"train.global_batch_size: {gb} completions per step is not a multiple of "
                f"train.rl.num_generations × data-parallel replicas = {rl.num_generations} × "
                f"{self.data_parallel} = {whole} (each prompt's group is sampled whole on one "
                "worker); use a multiple of it"
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
        if self.strategy.sp > 1:
            self._check_sequence(self.strategy.sp)
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
        if "gguf" in self.export.formats:
            self._check_gguf()
        if t.objective in RL_OBJECTIVES:
            self._check_rl()
        elif t.objective != "sft":
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

    def _check_sequence(self, sp: int) -> None:
        """What sequence parallelism needs from the config (the KV heads are checked from
        the model's config.json by trainer.parallel.layout, in preflight)."""
        st, s, t = self.strategy, self.scaling, self.train
        if isinstance(st, FSDPOptions) and st.model_parallel > 1:
            raise ValueError(
                f"strategy.sp: {sp} with strategy.tp/pp > 1 is not in this build; use sp with "
                "tp = pp = 1"
            )
        if s.elastic:
            raise ValueError(
                f"scaling.num_workers: [min, max] (elastic) needs strategy.sp = 1 (a sequence "
                f"split over {sp} workers cannot lose one); use a fixed num_workers"
            )
        if s.max_workers % sp:
            raise ValueError(
                f"strategy.sp: {sp} does not divide scaling.num_workers {s.max_workers}; use a "
                f"divisor of {s.max_workers}"
            )
        if self.data.block_size % sp:
            raise ValueError(
                f"data.block_size: {self.data.block_size} does not split into strategy.sp = "
                f"{sp} equal parts; use a multiple of {sp}"
            )
        # SFT's token loss and the pair losses (their per-sequence sums all-reduced over
        # the sp group: trainer.parallel.sequence) are exact; KTO's batch KL estimate and
        # RL's rollouts are not split over a group in this build.
        exact = ("sft", "dpo", "ipo", "hinge", "simpo", "orpo")
        if t.objective not in exact:
            raise ValueError(
                f"train.objective: {t.objective} with strategy.sp > 1 is not in this build "
                f"(sequence parallelism is exact for {', '.join(exact)}); use one of them or "
                "sp: 1"
            )

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
        """Workers that read one batch between them: tp × pp × sp (sequence parallelism
        splits each of the batch's sequences over its sp workers)."""
        st = self.strategy
        return (st.model_parallel if isinstance(st, FSDPOptions) else 1) * st.sp

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
        return 1 if self.train.objective in ("sft", *RL_OBJECTIVES) else 2

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
