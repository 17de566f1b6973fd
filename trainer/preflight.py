"""Checks that need more than the config itself: the model's config.json, the data and
special-tokens files, and the storage location. They run on the client before submitting
and on the cluster before any worker starts, so a bad input never costs GPU time.

Pure of torch and Ray: only the standard library, PyYAML/pydantic via the config, and
pyarrow for S3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import JobConfig
from trainer.errors import ConfigError, UserError
from trainer.model import hfconfig

SAMPLE_LINES = 1000


@dataclass
class Report:
    notes: list[str] = field(default_factory=list)
    max_positions: int | None = None
    hidden_size: int | None = None
    params: int | None = None
    deepspeed: dict | None = None
    """The final DeepSpeed config (every "auto" filled), built where the model's config
    could be read; the driver checks its NVMe paths on the worker nodes before launch."""


def _local_or_note(path: str, what: str, strict: bool, report: Report) -> Path | None:
    p = Path(path).expanduser()
    if p.exists():
        return p
    if _hub_note(path, what, report):
        return None
    if strict:
        raise UserError(f"{what} {path}: not found")
    report.notes.append(f"{what} {path}: not on this machine; checked on the cluster")
    return None


def _hub_note(path: str, what: str, report: Report) -> bool:
    """A Hub id is fetched by the driver (trainer.storage.hub) before this runs there."""
    from trainer.storage.hub import parse

    if parse(path, dataset=what.startswith("data.")) is None:
        return False
    report.notes.append(
        f"{what} {path}: a Hugging Face Hub id, fetched by the driver into shared storage "
        "before launch (HF_TOKEN for gated repositories)"
    )
    return True


def check_model(cfg: JobConfig, strict: bool, report: Report) -> None:
    src = hfconfig.config_uri(cfg.model.path)
    if cfg.model.path.startswith("s3://"):
        from trainer.storage.location import read_text

        text = read_text(src, cfg.storage.endpoint_override, cfg.storage.region)
    else:
        d = _local_or_note(cfg.model.path, "model.path", strict, report)
        if d is None:
            return
        if not (d / "config.json").is_file():
            raise UserError(
                f"model.path {d}: no config.json (expected a Hugging Face model folder)"
            )
        text = (d / "config.json").read_text()
    mcfg = hfconfig.parse(text, src)
    limit = mcfg.get("max_position_embeddings")
    report.max_positions = limit
    hidden = mcfg.get("hidden_size")
    report.hidden_size = hidden if isinstance(hidden, int) else None
    from trainer.planner.shape import ModelShape

    try:
        report.params = ModelShape.from_hf_config(mcfg, src).params
    except Exception:  # an architecture the planner does not model
        report.params = None
    from trainer.model import families

    report.notes += families.check(
        mconf=mcfg,
        where=src,
        attention=cfg.model.attn_implementation,
        adapter=cfg.model.adapter,
        targets=cfg.model.lora.target_modules,
        pp=getattr(cfg.strategy, "pp", 1),
    )
    if cfg.model_parallel > 1:
        from trainer.parallel.layout import check_model_layout

        check_model_layout(cfg.strategy, mcfg, src)
    check_nf4_shards(cfg, mcfg, src)
    check_gguf_family(cfg, mcfg, src)
    if isinstance(limit, int) and cfg.data.block_size > limit:
        raise ConfigError(
            f"data.block_size: {cfg.data.block_size} exceeds the model's "
            f"max_position_embeddings {limit} ({src})"
        )
    if cfg.model.tokenizer is None and not cfg.model.path.startswith("s3://"):
        d = Path(cfg.model.path)
        if d.exists() and not (d / "tokenizer.json").exists():
            raise UserError(
                f"model.path {d}: no tokenizer.json; set model.tokenizer to a folder with one"
            )


def check_gguf_family(cfg: JobConfig, mcfg: dict, src: str) -> None:
    """export.formats gguf for a family the GGUF writer does not map would fail at the
    first export, after training: refuse it before anything is paid for."""
    from trainer.config.export import GGUF_MODEL_TYPES

    kind = mcfg.get("model_type")
    if "gguf" in cfg.export.formats and kind not in GGUF_MODEL_TYPES:
        raise ConfigError(
            f"export.formats: gguf writes model_type {', '.join(GGUF_MODEL_TYPES)} in this "
            f"build, and {src} says {kind!r}; drop gguf from export.formats"
        )


def check_nf4_shards(cfg: JobConfig, mcfg: dict, src: str) -> None:
    """QLoRA on FSDP2 shards every 4-bit weight by rows, whole scale groups per rank
    (trainer.model.nf4_layout): a model or world size that cannot is refused here, in one line,
    not by an assertion deep in torchao on every worker."""
    if cfg.model.adapter != "qlora" or cfg.strategy.name != "fsdp":
        return
    from trainer.model.nf4_layout import shard_problem
    from trainer.planner.shape import ModelShape

    shape = ModelShape.from_hf_config(mcfg, src)
    sizes = sorted({cfg.data_parallel, cfg.scaling.min_workers // cfg.model_parallel})
    for name, (cols, rows) in shape.linear_shapes().items():
        for dp in sizes:
            problem = shard_problem(rows, cols, dp)
            if problem:
                raise ConfigError(
                    f"model.adapter qlora with strategy fsdp: {name} ({rows}×{cols}, {src}) "
                    f"cannot be sharded in NF4 over {dp} workers: {problem}; use another "
                    "scaling.num_workers, or strategy ddp"
                )


def check_data_file(
    path: str,
    what: str,
    strict: bool,
    on_bad_line: str,
    report: Report,
    objective: str = "sft",
    columns: dict[str, str] | None = None,
) -> None:
    """Existence, and the first rows' shape, so a wrong file fails in a second. Every row
    of every file is checked when the data is tokenized, still before workers start.
    A preference objective's rows are pairs (an explicit, implicit or string prompt), KTO's
    prompt/completion/label rows. The note says which
    shape the rows were read as (and a missing data.columns column fails here)."""
    from trainer.data.sources import list_local

    if objective == "sft":
        from functools import partial

        from trainer.data.shapes import sample_check as sft_check

        sample_check = partial(sft_check, columns=columns)
    elif objective in ("grpo", "rloo"):  # online RL: prompt rows
        from functools import partial

        from trainer.rollouts.rows import sample_check as prompt_check

        sample_check = partial(prompt_check, columns=columns)
    else:  # preference pairs, or KTO's unpaired rows
        from functools import partial

        from trainer.objectives.rows import sample_check as pair_check

        sample_check = partial(pair_check, unpaired=objective == "kto", columns=columns)

    if _hub_note(path, what, report):
        return
    if not strict and not path.startswith("s3://"):
        try:
            list_local(path)
        except UserError:
            report.notes.append(f"{what} {path}: not on this machine; checked on the cluster")
            return
    note = sample_check(path, what, on_bad_line, SAMPLE_LINES)
    if note:
        report.notes.append(note)


def check_storage(cfg: JobConfig, report: Report) -> None:
    try:
        from trainer.storage.location import check_writable, resolve
    except ImportError as exc:
        # A laptop with only the core install has no pyarrow; the driver runs this probe again
        # (strictly) on the cluster before any worker starts.
        report.notes.append(
            f"storage.path {cfg.storage.path}: not probed from here ({exc}); checked on the cluster"
        )
        return

    loc = resolve(cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region)
    check_writable(loc)
    check_deepspeed_resume(cfg, loc.join(cfg.run.name))


def check_deepspeed_resume(cfg: JobConfig, run: Any) -> None:
    """DeepSpeed loads its checkpoint only on the world size that wrote it: a resubmitted
    run with another num_workers would fail after every worker has loaded the model.
    Refuse it here, in one line, against the run's newest complete checkpoint (an
    adapter's checkpoint carries its state whole too, and loads on any size)."""
    if cfg.strategy.name != "deepspeed":
        return
    try:
        from trainer.checkpoint.manager import completeness, find_latest
    except ImportError:
        return  # a laptop without torch: the driver checks again before any worker starts
    latest = find_latest(run, allow_scratch=True)
    if latest is None:
        return
    state, _ = completeness(latest)
    if state is None or state.get("strategy") != "deepspeed":
        return  # another strategy's checkpoint: the identity check at restore names it
    portable = latest.join("strategy/adapter.pt")  # an adapter's state, whole: any size
    if portable.fs.get_file_info(portable.path).is_file:
        return
    # torchrun sets the world size itself; Ray Train runs scaling.num_workers workers.
    world = int(os.environ.get("WORLD_SIZE") or cfg.scaling.max_workers)
    wrote = int(state["world_size"])
    if wrote != world:
        raise ConfigError(
            f"{latest.uri}: this DeepSpeed checkpoint was written by {wrote} workers and "
            f"loads only on {wrote}; this job runs {world}. Set scaling.num_workers: {wrote} "
            "to resume, or use a new run.name"
        )


def run_all(cfg: JobConfig, strict: bool = True) -> Report:
    """Every check; `strict=False` on a client that may not see the cluster's shared FS."""
    report = Report()
    check_model(cfg, strict, report)
    if cfg.model.tokenizer and not cfg.model.tokenizer.startswith("s3://"):
        _local_or_note(cfg.model.tokenizer, "model.tokenizer", strict, report)
    if cfg.model.special_tokens:
        from trainer.data.sources import load_special_tokens

        if _local_or_note(cfg.model.special_tokens, "model.special_tokens", strict, report):
            load_special_tokens(cfg.model.special_tokens)
    for which in ("train", "eval"):
        for src in cfg.data.sources(which):
            value = cfg.data.train_file if which == "train" else cfg.data.eval_file
            what = f"data.{which}_file" + (f" ({src.name})" if isinstance(value, list) else "")
            check_data_file(
                src.path,
                what,
                strict,
                cfg.data.on_bad_line,
                report,
                cfg.train.objective,
                cfg.data.columns_for(src),
            )
    check_strategy(cfg, strict, report)
    check_storage(cfg, report)
    check_tracking(cfg, strict, report)
    if strict:
        check_compiler(cfg)
    check_eval_tasks(cfg, strict, report)
    return report


def check_eval_tasks(cfg: JobConfig, strict: bool, report: Report) -> None:
    """train.eval_tasks: each YAML there with its `task:` line, each name lm-eval's."""
    from trainer.evaluation.specs import check

    try:
        report.notes += check(cfg.train.eval_tasks, strict)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_compiler(cfg: JobConfig) -> None:
    """train.compile on a node without a C compiler fails at the first step, after the
    model is loaded and sharded: refuse it before any worker starts."""
    import os
    import shutil

    if not cfg.train.compile:
        return
    names = [os.environ.get("CC", ""), "cc", "gcc", "clang"]
    if any(shutil.which(n) for n in names if n):
        return
    raise UserError(
        "train.compile: no C compiler on this node (torch.compile builds its kernels on "
        "every node, and the Raylift images ship none): use an image with build-essential "
        "added, or set train.compile: false"
    )


TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboardX"}


def check_tracking(cfg: JobConfig, strict: bool, report: Report) -> None:
    """A tracker whose client is not installed where the job runs is an error before any
    worker starts (on a laptop, only a note: the image is what counts)."""
    import importlib.util

    for name in cfg.tracking.trackers:
        module = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is not None:
            if strict and name == "mlflow":
                from trainer.observability.tracking.backends import prepare_mlflow_store

                prepare_mlflow_store(cfg.tracking.mlflow.tracking_uri)  # type: ignore[union-attr]
            continue
        msg = (
            f"tracking.{name}: the {module} package is not installed here; install the "
            "trackers with pip install 'raylift[track]' (or remove tracking." + name + ")"
        )
        if strict:
            raise UserError(msg)
        report.notes.append(msg + "; checked again on the cluster")


def check_strategy(cfg: JobConfig, strict: bool, report: Report) -> None:
    """A DeepSpeed JSON is read and its "auto" values resolved against the job here, so a
    contradiction is an error on the laptop, not on the cluster. With the model's
    hidden size known (strict on the driver) the final config is built and checked here
    too: what the workers would build, refused before any of them starts."""
    if cfg.strategy.name != "deepspeed":
        return
    if cfg.checkpoint.memory_every not in (0, "auto"):  # auto: off with DeepSpeed
        raise ConfigError(
            "checkpoint.memory_every: the RAM tier does not cover DeepSpeed yet (its engine "
            "writes its state only through save_checkpoint to a folder, a full second "
            "checkpoint every snapshot); set checkpoint.memory_every: 0 or auto, or use "
            "strategy ddp or fsdp"
        )
    from trainer.strategies.deepspeed import config as dsconfig

    name = cfg.strategy.config  # type: ignore[union-attr]
    path = dsconfig.config_path(name)
    if path.parent != dsconfig.SHIPPED and not _local_or_note(
        str(path), "strategy.config", strict, report
    ):
        return
    raw, where = dsconfig.load(name)
    ds = dsconfig.resolve(raw, cfg, where, hidden_size=report.hidden_size)
    if report.hidden_size is not None:
        dsconfig.check(ds, where)
        report.deepspeed = ds
    _check_cpu_nvme_swap(cfg, ds, where, report.params)


def _check_cpu_nvme_swap(cfg: JobConfig, ds: dict, where: str, params: int | None) -> None:
    """DeepSpeed 0.19.8 swaps optimizer state to NVMe through its aio op; on CPU workers
    that path hangs after its first write (aio.overlap_events on, the template's value) or
    turns the loss NaN at the first swapped step (off), where the same run with device cpu
    trains. It swaps a tensor only at max(1 MiB, aio.block_size) or more, so a state that
    small never touches it; anything bigger is refused on CPU workers here (where the
    model's config is read: on the driver at the latest)."""
    from trainer.strategies.deepspeed import config as dsconfig

    if cfg.scaling.use_gpu or dsconfig.offload_device(ds, "offload_optimizer") != "nvme":
        return
    smallest = max(2**20, int(ds.get("aio", {}).get("block_size", 2**20)))
    per_tensor = 4 * (params or 0) / max(1, cfg.scaling.max_workers)  # fp32, one ZeRO share
    if params is not None and per_tensor >= smallest:
        raise ConfigError(
            f"{where}: zero_optimization.offload_optimizer.device nvme on CPU workers "
            "(scaling.use_gpu false): DeepSpeed 0.19.8's CPU NVMe swap hangs (aio."
            "overlap_events true) or turns the loss NaN at its first swapped step (false); "
            "set the offload device to cpu on CPU workers"
        )
