"""FSDP2 over the dp dim of a (dp, pp, tp) device mesh, with tensor and pipeline
parallelism from trainer.parallel when tp or pp is above 1.

The model is built (trainer.strategies.fsdp_build) as a skeleton (parameters on the meta
device, real buffers), cut to this rank's pipeline stage(s), split over tp, sharded over
dp, materialised, and only then filled from the safetensors files: every rank memory-maps
the checkpoint and copies in just its shards, so no rank ever holds the whole model. FSDP
does not broadcast initial weights the way DDP does, so the weights every rank builds must
be equal: the grown embedding rows come from a seeded generator (trainer.model.loading).

With an adapter (tp = pp = 1), PEFT wraps the skeleton on the meta device; the adapters'
initial values come from trainer.model.adapters (the same on every rank and strategy),
and under QLoRA every frozen linear is a torchao NF4 tensor that FSDP2 shards like any
parameter, filled one weight at a time (trainer.model.nf4). The resume state then holds
only what trains, and the export is the PEFT adapter folder.

With pp > 1 the strategy's train step runs the pipeline schedule (forward and backward of
every microbatch together); the loop still sees one call per micro step and a loss.

Resume state (layout `dcp/2`): a `torch.distributed.checkpoint` folder, sharded, with the
model and the *flattened* optimizer state, both keyed by Hugging Face parameter names, so
it loads on another (dp, pp, tp) layout and another world size (DCP reshards). The older
`dcp/1` (nested optimizer state) still loads into a plain FSDP run (tp = pp = 1). The
export gathers a plain Hugging Face folder.

Why one module of about 500 lines: it is one idea, the FSDP2 strategy behind the Strategy
seam. What it builds from (one part, `fsdp_build`) and the optimizer across a rank's
stages (`mesh_state`) already live apart; what stays here (the step, the pipeline
schedule's call, the resume state keyed by Hugging Face names, the export) acts on the same
mesh and the same parameter names, and reads as one strategy beside `ddp` and `deepspeed`.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import FSDPOptions, JobConfig
from trainer.errors import CheckpointError
from trainer.model import adapters
from trainer.model.loading import full_state_dict, model_config
from trainer.storage import staging
from trainer.strategies.base import ModelSource
from trainer.strategies.common import (
    Evaluating,
    ModelCalls,
    build_optimizer,
    torch_state_nbytes,
)
from trainer.strategies.fsdp_build import build_part, frozen_part
from trainer.strategies.mesh_state import OptimizerGroup, clip_grad_norm_mesh

IGNORE = -100


class FSDPStrategy(ModelCalls):
    name = "fsdp"
    layout = "dcp/2"

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int):
        assert isinstance(cfg.strategy, FSDPOptions)
        self.cfg = cfg
        self.opts: FSDPOptions = cfg.strategy
        self.device = device
        self.world_size = world_size
        self.pp, self.tp = self.opts.pp, self.opts.tp
        self.dp = world_size // (self.pp * self.tp)
        # Plain FSDP still reads the nested optimizer state it wrote before dcp/2.
        self.reads_layouts: tuple[str, ...] = ("dcp/1",) if self.pp == self.tp == 1 else ()
        self.adapter = adapters.enabled(cfg)
        """Adapters: the resume state and the export hold only what trains."""
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.parts: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    # ------------------------------------------------------------------ building

    def setup(self, source: ModelSource) -> None:
        from trainer.parallel.mesh import Layout, build_mesh

        if not dist.is_initialized():
            # One process (torchrun with one rank): FSDP still needs a process group.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.mesh = build_mesh(Layout(self.dp, self.pp, self.tp), self.device)
        self.source_dir, self.source = source.model_dir, source
        conf = model_config(source.model_dir, self.cfg, source.vocab_size)
        std = float(getattr(conf, "initializer_range", 0.02))
        weights = full_state_dict(source.model_dir, source.vocab_size, std, self.cfg.train.seed)
        self.n_stages = self.pp * self.opts.stages_per_rank
        if self.pp > 1:
            from trainer.parallel.pipeline import stage_ids

            pp_rank = self.mesh["pp"].get_local_rank()
            self.stage_ids = stage_ids(
                pp_rank, self.pp, self.opts.stages_per_rank, self.opts.pp_schedule
            )
        else:
            self.stage_ids = [0]
        self.parts = []
        for stage in self.stage_ids:
            part, nf4_load = build_part(
                self.cfg, self.device, self.mesh, self.n_stages, conf, stage, weights, source
            )
            self.parts.append(part)
            if nf4_load is not None:
                self.nf4_load = nf4_load
        keep = not self.adapter
        self.optimizers = [build_optimizer(self.cfg, part, keep) for part in self.parts]
        if len(self.parts) == 1:
            self.model, self.optimizer = self.parts[0], self.optimizers[0]
        else:
            self.model = torch.nn.ModuleList(self.parts)
            self.optimizer = OptimizerGroup(self.optimizers)
        if self.pp > 1:
            self._build_schedule()

    def frozen_copy(self) -> torch.nn.Module:
        """GRPO's reference in full fine-tuning: the starting weights, sharded as the policy."""
        return frozen_part(self.cfg, self.device, self.mesh, self.source)

    def param_count(self) -> int:
        """Every stage's parameters: this rank's stages, summed over the pipeline ranks
        (a DTensor counts its global size, so dp and tp shards count once)."""
        mine = sum(p.numel() for part in self.parts for p in part.parameters())
        if self.pp == 1:
            return mine
        total = torch.tensor([mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.mesh["pp"].get_group())
        return int(total.item())

    def _build_schedule(self) -> None:
        from torch.distributed.pipelining import PipelineStage

        from trainer.parallel.pipeline import build_schedule

        group = self.mesh["pp"].get_group()
        stages = [
            PipelineStage(part, s, self.n_stages, self.device, group=group)
            for part, s in zip(self.parts, self.stage_ids, strict=True)
        ]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.n_stages - 1 in self.stage_ids
        if self.has_last:
            self.last_part = self.parts[self.stage_ids.index(self.n_stages - 1)]
        self._divisor = torch.ones((), device=self.device)
        self.schedule = build_schedule(
            self.opts.pp_schedule, stages, self.opts.n_microbatches, self._loss
        )

    # ------------------------------------------------------------------ steps

    def precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the mixed-precision policy casts per module

    @contextlib.contextmanager
    def accumulating(self, last_micro_step: bool) -> Iterator[None]:
        if self.pp == 1:
            # Under pp the stages sync FSDP's gradients themselves, once per schedule step.
            self.model.set_requires_gradient_sync(last_micro_step)  # type: ignore[operator]
        yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from trainer.parallel.pipeline import last_stage_loss

        return last_stage_loss(self.last_part, out, labels, self._divisor)

    def _pipeline(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> tuple[Any, torch.Tensor]:
        """One schedule step over micro batch (x, y); (last stage's outputs, the summed
        microbatch losses, the same on every stage of the pipeline)."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        target = y if self.has_last else None
        if train:
            out = self.schedule.step(*args, target=target, losses=losses if self.has_last else None)
        elif self.opts.pp_schedule == "zbv":
            out = self._forward_only(x, y, losses)  # torch's ZB-V cannot run forward-only
        else:
            out = self.schedule.eval(*args, target=target, losses=losses if self.has_last else None)
        total = torch.zeros((), device=self.device)
        if self.has_last:
            total = torch.stack([loss.detach().float() for loss in losses]).sum()
        # Only the last stage has the loss; the other stages report it too.
        dist.all_reduce(total, group=self.mesh["pp"].get_group())
        return out, total

    def _forward_only(self, x: torch.Tensor, y: torch.Tensor, losses: list[Any]) -> Any:
        """The whole batch through the stages in order, hidden states sent point to point
        between the ranks that own neighbouring stages (no grad, no microbatches)."""
        from trainer.parallel.pipeline import stage_ids

        group = self.mesh["pp"].get_group()
        me = self.mesh["pp"].get_local_rank()
        owner = {}
        for r in range(self.pp):
            for st in stage_ids(r, self.pp, self.opts.stages_per_rank, self.opts.pp_schedule):
                owner[st] = r
        parts = dict(zip(self.stage_ids, self.parts, strict=True))
        hidden = self.parts[0].config.hidden_size
        h: Any = x
        for st in range(self.n_stages):
            if owner[st] != me:
                continue
            if st > 0 and owner[st - 1] != me:
                h = torch.empty((*x.shape, hidden), device=self.device)
                dist.recv(h, group=group, group_src=owner[st - 1])
            h = parts[st](h)
            if st < self.n_stages - 1 and owner[st + 1] != me:
                dist.send(h.contiguous(), group=group, group_dst=owner[st + 1])
        if self.has_last:
            losses.append(self._loss(h, y))
            return h
        return None

    def train_micro(
        self, x: torch.Tensor, y: torch.Tensor, num_items: Any, **attention: Any
    ) -> torch.Tensor:
        if self.pp == 1:
            return super().train_micro(x, y, num_items, **attention)
        _causal_only(attention)
        self._divisor = torch.as_tensor(num_items, device=self.device, dtype=torch.float32)
        return self._pipeline(x, y, train=True)[1]

    def _fixed_shape(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad a batch to the training shape (micro_batch_size × block_size): the stages'
        communication buffers are shaped by the first step. Padded targets are ignored,
        and attention is causal, so the real rows' and positions' results are unchanged."""
        rows, cols = self.cfg.train.micro_batch_size, self.cfg.data.block_size
        xp = torch.zeros((rows, cols), dtype=x.dtype, device=x.device)
        yp = torch.full((rows, cols), IGNORE, dtype=y.dtype, device=y.device)
        xp[: x.shape[0], : x.shape[1]] = x
        yp[: y.shape[0], : y.shape[1]] = y
        return xp, yp

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, **attention: Any) -> float:
        if self.pp == 1:
            return super().eval_loss(x, y, **attention)
        _causal_only(attention)
        n = int((y[:, 1:] != IGNORE).sum())
        self._divisor = torch.ones((), device=self.device)
        _, total = self._pipeline(*self._fixed_shape(x, y), train=False)
        return float(total) / max(n, 1)

    def logits(self, x: torch.Tensor, **attention: Any) -> torch.Tensor:
        if self.pp == 1:
            return super().logits(x, **attention)
        _causal_only(attention)
        xp, yp = self._fixed_shape(x, torch.full_like(x, IGNORE))
        self._divisor = torch.ones((), device=self.device)
        out, _ = self._pipeline(xp, yp, train=False)
        vocab = self.parts[0].config.vocab_size
        logits = torch.zeros((x.shape[0], x.shape[1], vocab), device=self.device)
        if self.has_last:
            from trainer.parallel.pipeline import stage_logits

            kept = out[: x.shape[0], : x.shape[1]]
            # With the chunked loss the stage gave hidden states and its lm_head makes the
            # logits here, after the schedule: FSDP2 may have resharded the root by then.
            self.last_part.unshard()  # type: ignore[operator]
            logits = stage_logits(self.last_part, kept).float().contiguous()
            self.last_part.reshard()  # type: ignore[operator]
        dist.all_reduce(logits, group=self.mesh["pp"].get_group())
        return logits

    def step(self) -> torch.Tensor:
        params = [p for part in self.parts for p in part.parameters()]
        norm = clip_grad_norm_mesh(params, self.cfg.optim.grad_clip, replicas=self.dp * self.tp)
        # Through the group, when there are several: the LR scheduler watches its step.
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def evaluating(self) -> contextlib.AbstractContextManager:
        return Evaluating(self.model)

    # ------------------------------------------------------------------ state

    def _state(self) -> tuple[dict[str, Any], list[tuple[set[str], set[str]]]]:
        """The whole rank's resume state, HF names, flattened optimizer state (so the
        parts of several stages on one rank merge, and another layout can pick its
        own), and each part's own keys (to hand each part only what is its)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opts = self._state_options()
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        keys = []
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            msd, osd = get_state_dict(part, opt, options=opts)
            model_sd.update(msd)
            optim_sd.update(osd)
            keys.append((set(msd), set(osd)))
        return {"model": model_sd, "optim": optim_sd}, keys

    def _state_options(self) -> Any:
        """Flattened optimizer state; with adapters only what trains (the frozen base is
        rebuilt from the model source, and loading then leaves it alone)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(
            flatten_optimizer_state_dict=True,
            ignore_frozen_params=self.adapter,
            strict=not self.adapter,
        )

    def save_state(self, out: Path, rank: int) -> None:
        """The one place a dcp/2 resume state is written (an async saver wraps this)."""
        import torch.distributed.checkpoint as dcp

        state, _ = self._state()
        dcp.save(state, checkpoint_id=str(out / "dcp2"))

    def stage_state(self, out: Path, rank: int) -> staging.Writer:
        """dcp/2 through DCP's async_save: the shards are copied to host memory here
        (pinned on GPUs), planned and written by DCP's thread on a gloo group of their
        own (collectives of a second thread must not share the training's group);
        the returned writer waits for that write. Same files as `save_state`.

        One DCP save at a time: each runs its collectives (plan, then finish) on its own
        thread over that group, and two in flight would interleave them in an order that
        can differ between ranks, which deadlocks both saves (seen in CI with a
        checkpoint every 2 steps). So a save that comes while the last is still writing
        waits for it here first; every rank saves the same steps, in the same order."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        previous = getattr(self, "_dcp_save", None)
        if previous is not None:
            # Its outcome is the writer's to report (a failure fails that upload); if
            # its waiter gave it up as hung, this raises rather than wait forever.
            staging.wait_unless_stuck(previous)
        state, _ = self._state()
        gpu = self.device.type == "cuda"
        # One stager for the run: it keeps its host copies and copies the next save into
        # them (trainer.storage.staging.Stager says why), which is safe because the save before
        # has finished reading them (above).
        stager = getattr(self, "_dcp_stager", None)
        if stager is None:
            stager = self._dcp_stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=gpu,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=gpu,
                )
            )
        future = dcp.async_save(
            state,
            checkpoint_id=str(out / "dcp2"),
            storage_writer=_background_writer_class()(str(out / "dcp2")),
            process_group=self._checkpoint_group(),
            async_stager=stager,
        )
        self._dcp_save = future

        def write() -> None:
            future.result()

        return write

    def _checkpoint_group(self) -> Any:
        """A gloo group over every rank for DCP's background collectives, made the first
        time (collective: every rank checkpoints the same steps)."""
        if not dist.is_initialized():
            return None  # one process without a process group: DCP plans locally
        if getattr(self, "_ckpt_group", None) is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def load_state(self, ckpt: Path, rank: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not (ckpt / "dcp2" / ".metadata").exists():
            if (ckpt / "dcp" / ".metadata").exists():
                return self._load_dcp1(ckpt)
            raise CheckpointError(f"{ckpt}/dcp2: no DCP metadata; not an FSDP resume state")
        state, keys = self._state()
        try:
            dcp.load(state, checkpoint_id=str(ckpt / "dcp2"))
        except Exception as exc:  # DCP wraps a missing key in a CheckpointException
            if not self.adapter:
                raise
            raise CheckpointError(
                f"{ckpt}/dcp2: the checkpoint's trainable weights do not match this job's "
                f"adapter ({str(exc).splitlines()[0][:200]}); keep model.adapter and "
                "model.lora equal to resume, or use a new run.name"
            ) from None
        opts = self._state_options()
        for part, opt, (mkeys, okeys) in zip(self.parts, self.optimizers, keys, strict=True):
            set_state_dict(
                part,
                opt,
                model_state_dict={k: state["model"][k] for k in mkeys},
                optim_state_dict={k: state["optim"][k] for k in okeys},
                options=opts,
            )

    def _load_dcp1(self, ckpt: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if self.pp * self.tp > 1:
            raise CheckpointError(
                f"{ckpt}: written in layout dcp/1 (plain FSDP, nested optimizer state), "
                f"which loads only with tp = pp = 1; this job (tp {self.tp}, pp {self.pp}) "
                "needs dcp/2: resume once with tp = pp = 1 and checkpoint, or use a new run.name"
            )
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )

    def export(self, out: Path, rank: int, tokenizer: Any) -> bool:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pp == 1:
            full = get_model_state_dict(
                self.model,
                options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.adapter
                ),
            )
            if rank != 0:
                return False
            if self.adapter:
                adapters.export(
                    self.model, out, tokenizer, self.cfg, self.source_dir, state_dict=full
                )
                return True
            self.model.save_pretrained(out / "model", state_dict=full, safe_serialization=True)  # type: ignore[operator]
            if tokenizer is not None:
                tokenizer.save_pretrained(out / "model")
            return True
        return self._export_stages(out, rank, tokenizer)

    def _export_stages(self, out: Path, rank: int, tokenizer: Any) -> bool:
        """Each stage's first worker writes its stage's weights as one safetensors shard
        of a plain HF folder; rank 0 adds the index, the config and the tokenizer. No rank
        holds more than its own stages' full weights."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full: dict[str, torch.Tensor] = {}
        for part in self.parts:
            # Gathered on every worker of the stage (cpu_offload would keep it on global
            # rank 0 only, which holds no stage but the first).
            sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            full.update({k: v.detach().cpu().contiguous() for k, v in sd.items()})
        writer = self.mesh["dp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0
        pp_rank = self.mesh["pp"].get_local_rank()
        name = f"model-{pp_rank + 1:05d}-of-{self.pp:05d}.safetensors"
        shards: list[Any] = [None] * self.world_size
        sizes = {k: v.numel() * v.element_size() for k, v in full.items()}
        entry = (name, sizes) if writer else None
        dist.all_gather_object(shards, entry)
        if not writer:
            return False
        folder = out / "model"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(full, str(folder / name), metadata={"format": "pt"})
        if rank == 0:
            weight_map = {k: f for f, sizes in filter(None, shards) for k in sizes}
            total = sum(n for _, sizes in filter(None, shards) for n in sizes.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            self.parts[0].config.save_pretrained(folder)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
        return True

    def state_nbytes(self) -> dict[str, int]:
        # Parameters, grads and Adam moments are DTensors: their local (padded) shards.
        return torch_state_nbytes(self.model, self.optimizer)


@functools.cache
def _background_writer_class() -> type:
    """DCP's file writer, whose writes run at the background checkpoint priority
    (`checkpoint.background_nice`). `write_data` runs on the thread async_save starts
    for the save, never on the training thread."""
    from torch.distributed.checkpoint import FileSystemWriter

    class BackgroundFileSystemWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            staging.lower_priority()
            return super().write_data(plan, planner)

    return BackgroundFileSystemWriter


def _causal_only(attention: dict[str, Any]) -> None:
    """Pipeline stages build their own causal mask; the config refuses document attention
    with pp > 1, so a mask arriving here is a bug, not a setting to ignore."""
    if attention:
        raise RuntimeError("document attention reached a pipelined model (pp > 1)")
