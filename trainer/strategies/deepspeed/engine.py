"""DeepSpeed ZeRO-2 / ZeRO-3 (optionally offloading optimizer state and parameters to CPU
or NVMe), configured from a stock DeepSpeed JSON whose "auto" values come from the job.

The engine owns loss scaling, accumulation boundaries and clipping; this module only
translates the loop's calls. ZeRO-3 models are built partitioned (transformers'
`HfDeepSpeedConfig` makes `from_pretrained` load straight into `zero.Init`).

Resume state (layout `deepspeed/1`): DeepSpeed's own checkpoint folder (`ds/`), one
optimizer partition file per rank. The export gathers the 16-bit (compute-dtype) weights
on rank 0 and saves a plain Hugging Face folder.

With a LoRA adapter, PEFT wraps the loaded (ZeRO-3: partitioned) base before
`deepspeed.initialize`, which partitions the new adapter weights too; the checkpoint
leaves the frozen base out, and the export gathers only the adapters into a PEFT folder.
Beside DeepSpeed's folder, rank 0 writes `adapter.pt` (trainer.strategies.deepspeed.portable):
each trainable weight and its Adam moments whole (fp32, gathered through DeepSpeed's
tensor-fragment API) and the step count. DeepSpeed's folder loads only on the world size
that wrote it; on another one the resume loads `adapter.pt` into the new partitions
(Adam is elementwise, so only the gradients' reduction order differs from an uninterrupted
run). QLoRA is refused by the config (ZeRO cannot partition a 4-bit base).

A checkpoint step does not write those files: `engine.save_checkpoint` runs as usual (its
barriers, its folders, its choice of which rank writes what) with a checkpoint engine
that copies each state dict it is handed into host memory instead of serialising it; the
engine's own checkpoint engine then writes the copies on the background thread
(trainer.storage.staging): the same files, with the same serialisation (a file can be smaller:
the copies are compact where DeepSpeed would have pickled a view's whole storage).

On CPU (`DS_ACCELERATOR=cpu`, gloo) DeepSpeed JIT-compiles its C++ ops on first use
(about 30 s each on 2 cores; the inference-only shared-memory comm op is skipped);
`TORCH_EXTENSIONS_DIR` defaults to a cache shared by every process on the node, so the
build is paid once per node, not per worker or per run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainer.config import DeepSpeedOptions, JobConfig
from trainer.errors import CheckpointError, UserError
from trainer.model import adapters
from trainer.model.loading import DTYPES, load_model, model_config
from trainer.objectives import linear_ce
from trainer.storage import staging
from trainer.strategies.base import ModelSource, param_groups
from trainer.strategies.common import (
    Evaluating,
    ModelCalls,
    StorageCounter,
    optimizer_state_tensors,
    param_tensors,
)
from trainer.strategies.deepspeed import config as dsconfig
from trainer.strategies.deepspeed.portable import PORTABLE, load_portable, portable_state

EXTENSIONS_DIR = str(Path(tempfile.gettempdir()) / "raylift" / "torch_extensions")
"""Where DeepSpeed's JIT-built ops go when the image has none prebuilt (CPU runs here): one
folder per machine that every worker shares, so the build is paid once. Under TMPDIR like
the model cache, so a fresh TMPDIR really starts cold."""
TAG = "state"


def prepare_environment(device: torch.device) -> None:
    """Before deepspeed is imported: its accelerator and its JIT build cache. The build
    runs the `ninja` found first on PATH; the one installed next to this interpreter (the
    venv's, from the pinned packages) goes first, so every process on the node uses the
    same ninja: another version reads the cache's build log as stale and rebuilds."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    Path(os.environ["TORCH_EXTENSIONS_DIR"]).mkdir(parents=True, exist_ok=True)
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(here) / "ninja").exists() and path[:1] != [here]:
        os.environ["PATH"] = os.pathsep.join([here, *path])


def skip_inference_comm_op() -> None:
    """On CPU, DeepSpeed's comm backend JIT-builds its shared-memory all-reduce op
    (`deepspeed_shm_comm`, ~45 s of compiling per node on 2 cores), after probing every op
    with compiler runs. Only `inference_all_reduce` uses it; training's collectives go
    through torch.distributed. DeepSpeed caches that probe as the module attribute
    `deepspeed.ops.__compatible_ops__`, read only by the comm backend (0.19.8), so filling
    it in first, with the op marked unusable, skips both."""
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


class DeepSpeedStrategy(ModelCalls):
    name = "deepspeed"
    layout = "deepspeed/1"

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int):
        assert isinstance(cfg.strategy, DeepSpeedOptions)
        self.cfg = cfg
        self.device = device
        self.world_size = world_size
        self._last = True
        self._stager = staging.Stager()
        self.model: Any
        self.optimizer: torch.optim.Optimizer

    def setup(self, source: ModelSource) -> None:
        prepare_environment(self.device)
        try:
            import deepspeed
        except ImportError:
            raise UserError(
                "strategy deepspeed: the deepspeed package is not installed (use the trainer image)"
            ) from None
        if self.device.type == "cpu":
            skip_inference_comm_op()
        cfg = self.cfg
        # Adopt the process group Ray Train or torchrun made (gloo on CPU, nccl on GPU);
        # ZeRO-3's partitioned init reads the world size from deepspeed.comm.
        deepspeed.init_distributed(dist_backend=cfg.backend, auto_mpi_discovery=False)
        raw, where = dsconfig.load(cfg.strategy.config)  # type: ignore[union-attr]
        conf = model_config(source.model_dir, cfg, source.vocab_size)
        ds = dsconfig.resolve(raw, cfg, where, hidden_size=int(conf.hidden_size))
        dsconfig.check(ds, where)
        self.stage = dsconfig.stage(ds)
        self.ds_config = ds
        if self.stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            # Must stay alive while the model loads: from_pretrained reads it to partition.
            self._hf_ds = HfDeepSpeedConfig(ds)
        model = load_model(source.model_dir, cfg, source.vocab_size)
        linear_ce.configure(model, cfg.train.loss, cfg.train.loss_chunk)
        self.source_dir, self.vocab_size = source.model_dir, source.vocab_size
        self.adapter = adapters.enabled(cfg)
        if self.adapter:
            # PEFT over the (ZeRO-3: partitioned) base; its new adapter weights are plain
            # tensors until deepspeed.initialize partitions them.
            grew = adapters.grew_vocab(source.model_dir, source.vocab_size)
            model = adapters.apply(model, cfg, grew_vocab=grew)
            adapters.one_trainable_dtype(model, DTYPES[dsconfig.precision(ds)])
        optimizer = self._client_optimizer(model, ds)
        engine, ds_opt, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=param_groups(model, cfg.optim.weight_decay, not self.adapter)
            if optimizer is None
            else None,
            config=ds,
            dist_init_required=False,
        )
        self.engine = engine
        self.model = engine
        # The LR scheduler drives the innermost torch optimizer's param groups, which the
        # ZeRO wrapper reads at each step.
        self.optimizer = getattr(ds_opt, "optimizer", ds_opt)

    def _client_optimizer(self, model: torch.nn.Module, ds: dict[str, Any]) -> Any:
        """For a JSON without an `optimizer` section (the Ray template's), the optimizer
        DeepSpeed would use for that placement, with the job's optim values: its C++ CPU
        Adam in AdamW mode when the optimizer state is offloaded (DeepSpeed refuses any
        other there, and its check stays on), torch's AdamW otherwise (fused on CUDA).
        None when the JSON names its optimizer: DeepSpeed builds it from the filled
        params."""
        kind = dsconfig.client_optimizer(ds)
        if kind is None:
            return None
        o = self.cfg.optim
        groups = param_groups(model, o.weight_decay, keep_empty=not adapters.enabled(self.cfg))
        if kind == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(
                groups,
                lr=o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
                adamw_mode=True,
            )
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(
            groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused, foreach=None if fused else True
        )

    def frozen_copy(self) -> torch.nn.Module:
        """GRPO's reference in full fine-tuning: the starting weights, frozen. ZeRO-3 loads
        them partitioned (the HfDeepSpeedConfig of setup is still alive) into an engine of
        their own without an optimizer, whose hooks gather each layer for its forward (as
        TRL's prepare_deepspeed does); ZeRO-2 keeps a whole copy."""
        import copy

        import deepspeed

        if self.stage != 3:
            return copy.deepcopy(self.engine.module).requires_grad_(False).eval()
        model = load_model(self.source_dir, self.cfg, self.vocab_size).requires_grad_(False)
        ds = copy.deepcopy(self.ds_config)
        for key in ("optimizer", "scheduler"):
            ds.pop(key, None)
        ds["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, config=ds, dist_init_required=False)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine

    def precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine runs the model in bf16/fp16 itself

    @contextlib.contextmanager
    def accumulating(self, last_micro_step: bool) -> Any:
        self._last = last_micro_step
        yield

    def backward(self, loss: torch.Tensor) -> None:
        # The loop's loss is already this micro-batch's share of the global token mean.
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self._last:
            self.engine.step()  # DeepSpeed counts micro steps; it updates at the boundary

    def step(self) -> torch.Tensor | float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # a tensor is read when reported
        return norm if norm is not None else float("nan")

    def evaluating(self) -> contextlib.AbstractContextManager:
        return Evaluating(self.engine)

    def _save(self, out: Path) -> None:
        # With adapters the module file holds only what trains (the base is the source's).
        self.engine.save_checkpoint(
            str(out / "ds"), tag=TAG, save_latest=False, exclude_frozen_parameters=self.adapter
        )

    def save_state(self, out: Path, rank: int) -> None:
        self._save(out)
        # Collective: every rank takes part in gathering what rank 0 writes.
        portable = portable_state(self.engine, self.optimizer) if self.adapter else None
        if portable is not None and rank == 0:
            torch.save(portable, out / PORTABLE)

    def stage_state(self, out: Path, rank: int) -> staging.Writer:
        """Collective, like `save_state`: DeepSpeed's save runs now against a staging
        checkpoint engine (host-memory copies of the state dicts it would write); the
        returned writer serialises them with the engine's own checkpoint engine."""
        own = self.engine.checkpoint_engine
        buffers = self._stager.claim()
        staged = _staging_engine_class()(self.device.type == "cuda", buffers)
        self.engine.checkpoint_engine = staged
        try:
            self._save(out)
        except BaseException:
            self._stager.release(buffers)
            raise
        finally:
            self.engine.checkpoint_engine = own
        files = staged.take()
        try:
            portable = (  # collective; its own copies already
                portable_state(self.engine, self.optimizer) if self.adapter else None
            )
        except BaseException:
            self._stager.release(buffers)
            raise
        if portable is not None and rank == 0:
            files.append((str(out / PORTABLE), portable))

        def write() -> None:
            try:
                for path, state in files:
                    own.save(state, path)
            finally:
                self._stager.release(buffers)

        return write

    def load_state(self, ckpt: Path, rank: int) -> None:
        if not (ckpt / "ds" / TAG).is_dir():
            raise CheckpointError(f"{ckpt}/ds/{TAG}: no DeepSpeed checkpoint")
        wrote = _written_by(ckpt)
        if wrote is not None and wrote != self.world_size:
            if self.adapter and (ckpt / PORTABLE).is_file():
                load_portable(self.engine, self.optimizer, self.stage, ckpt / PORTABLE)
                return
            raise CheckpointError(
                f"{ckpt}/ds: written by {wrote} workers, and DeepSpeed loads it only on "
                f"{wrote}; this attempt has {self.world_size}. Set scaling.num_workers: "
                f"{wrote} to resume, or use a new run.name"
            )
        path, _ = self.engine.load_checkpoint(
            str(ckpt / "ds"),
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=not self.adapter,
        )
        if path is None:
            raise CheckpointError(
                f"{ckpt}/ds: DeepSpeed could not load its checkpoint (a different world "
                "size or ZeRO stage?); resume with the same num_workers and config"
            )

    def export(self, out: Path, rank: int, tokenizer: Any) -> bool:
        module = self.engine.module
        if self.adapter:
            return self._export_adapter(out, rank, tokenizer)
        if self.stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective
        else:
            state = module.state_dict() if rank == 0 else None
        if rank != 0:
            return False
        module.save_pretrained(out / "model", state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "model")
        return True

    def _export_adapter(self, out: Path, rank: int, tokenizer: Any) -> bool:
        """The trainable weights gathered (ZeRO-3: collectively) into rank 0's PEFT
        folder; the merged export loads a fresh base, so the process's ZeRO-3 config is
        dropped first (it would partition that load, on rank 0 alone)."""
        import deepspeed

        module = self.engine.module
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        gather = (
            deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=None)
            if self.stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            state = {n: p.detach().float().cpu().clone() for n, p in trainable}
        if rank != 0:
            return False
        if self.stage == 3:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        adapters.export(module, out, tokenizer, self.cfg, self.source_dir, state_dict=state)
        return True

    def state_nbytes(self) -> dict[str, int]:
        """ZeRO keeps its state in flat buffers the module never shows: the parameter
        partitions (ZeRO-3, behind each parameter's `ds_tensor`) or the flat bit16 groups
        (ZeRO-2), the fp32 master partitions (a separate copy unless they already are the
        fp32 parameter partitions), the partitioned gradient buffers and reduce buckets,
        and the inner optimizer's moments (in CPU RAM when offloaded)."""
        zero = self.engine.optimizer
        params = list(self.engine.module.parameters())
        count = StorageCounter()
        return {
            "params": count.add(
                [
                    *param_tensors(params),
                    *(getattr(p, "ds_tensor", None) for p in params),
                    *_tensors(
                        zero,
                        "bit16_groups_flat",
                        "fp16_partitioned_groups_flat",
                        "param_groups_fp16_flat_cpu_memory",  # ZeRO-3 with offload_param
                    ),
                ]
            ),
            "optimizer": count.add(
                [
                    *_tensors(
                        zero, "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"
                    ),
                    *optimizer_state_tensors(self.optimizer),
                ]
            ),
            "grads": count.add(
                [
                    *(p.grad for p in params),
                    *_tensors(
                        zero,
                        "grad_partitions_flat_buffer",
                        "grads_in_partition",
                        "averaged_gradients",
                        "ipg_buffer",
                    ),
                    # Reduce buckets: a tensor (ZeRO-3) or a list of them (ZeRO-1/2).
                    *_flatten(
                        [
                            getattr(b, "buffer", None)
                            for b in getattr(zero, "ipg_buckets", {}).values()
                        ]
                    ),
                ]
            ),
        }


def _written_by(ckpt: Path) -> int | None:
    """The world size that wrote the checkpoint whose strategy folder is `ckpt`."""
    import json

    from trainer.storage.staging import STATE_FILE

    state_file = ckpt.parent / STATE_FILE
    if not state_file.is_file():
        return None
    return int(json.loads(state_file.read_text())["world_size"])


def _tensors(obj: Any, *names: str) -> list[Any]:
    """The tensors under `obj`'s attributes `names`; attributes the ZeRO stage in use does
    not have are skipped."""
    return _flatten([getattr(obj, name, None) for name in names])


def _flatten(value: Any) -> list[Any]:
    """Tensors in a tensor, or in (nested) lists, tuples and dicts of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in _flatten(v)]
    return []


@functools.cache
def _staging_engine_class() -> type:
    """`StagingCheckpointEngine`, a subclass of DeepSpeed's CheckpointEngine, defined on
    first use so that importing this module does not import deepspeed."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class StagingCheckpointEngine(CheckpointEngine):
        """For one save: `save(state_dict, path)` keeps a host-memory copy
        (trainer.storage.staging.snapshot: every tensor copied, so the optimizer may step on)
        instead of writing; `take()` hands the copies over. Folders are still made at
        once (DeepSpeed makes them, and copies its recovery scripts, inline)."""

        def __init__(self, pin: bool, buffers: staging.Buffers | None = None) -> None:
            super().__init__(None)
            self.name = "RayliftStagingCheckpointEngine"
            self.pin = pin
            self.buffers = buffers
            self._files: list[tuple[str, Any]] = []

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            self._files.append((path, staging.snapshot(state_dict, self.pin, self.buffers)))

        def load(self, path: str, map_location: Any = None) -> Any:
            raise CheckpointError("the staging checkpoint engine only saves")

        def commit(self, info: Any) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False  # the snapshot is a compact copy already: no clone needed

        def take(self) -> list[tuple[str, Any]]:
            files, self._files = self._files, []
            return files

    return StagingCheckpointEngine
