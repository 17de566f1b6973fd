"""The driver: preflight, tokenize once, then start the workers (Ray Train or torchrun).

This runs where `python -m trainer run` runs: the Ray job's entrypoint on the head node,
or every torchrun process. Everything that can fail on user input fails here, before a
worker group is created.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainer import faults, preflight
from trainer.config import JobConfig
from trainer.data.tokenize import Settings, prepare, read_chat_template
from trainer.errors import UserError
from trainer.loop import Prepared
from trainer.runtime.worker import run_location

log = logging.getLogger("trainer.runtime.launch")


def prepare_inputs(cfg: JobConfig, progress: bool = True) -> Prepared:
    """Resolve model/tokenizer folders (downloading S3 ones to this node) and tokenize the
    data into caches next to it, which every worker then memory-maps."""
    if cfg.train.objective in ("grpo", "rloo"):  # online RL: prompt rows, read once here
        from trainer.checkpoint.past_runs import for_driver
        from trainer.rollouts.prompts import prepare_prompts

        return Prepared(train_caches=prepare_prompts(cfg), past_faults=for_driver(cfg))
    from trainer.data.tokenize import TokenizerFiles
    from trainer.model.loading import local_tokenizer_dir

    tokenizer = TokenizerFiles(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    settings = data_settings(cfg)
    common = dict(cache_root=cfg.data.cache_dir, progress=progress, settings=settings)
    if _tokenize_on_cluster(cfg):
        from trainer.data.cluster import tokenize_on_cluster

        common["tokenize_shards"] = tokenize_on_cluster
    if cfg.train.objective != "sft":  # preference pairs: one block per sequence
        from trainer.objectives.pairs import data_options

        common.update(data_options(cfg, settings))

    # One cache per source, keyed by that source's own inputs: adding a source to a mix
    # does not tokenize the others again.
    def cache(src: Any) -> Any:
        return prepare(src.path, tokenizer, columns=cfg.data.columns_for(src), **common)

    train = [cache(src) for src in cfg.data.sources("train")]
    evals = [cache(src) for src in cfg.data.sources("eval")]
    # A mix draws blocks of each source as often as its weight says, so one block is
    # enough there; a single source must fill a global batch.
    need = cfg.global_batch if len(train) == 1 else 1
    for src, cache in zip(cfg.data.sources("train"), train, strict=True):
        # a preference pair is two blocks (chosen, rejected); the batch counts pairs
        blocks = cache.meta["num_tokens"] // cfg.data.block_size // cfg.sequences_per_example
        if blocks < need:
            raise UserError(
                f"data.train_file {src.path}: {blocks} blocks of {cfg.data.block_size} tokens "
                f"are fewer than {need}; add data or lower the batch/block size"
            )
    from trainer.checkpoint.past_runs import for_driver

    return Prepared(
        train_caches=[str(c.dir) for c in train],
        eval_caches=[str(c.dir) for c in evals],
        past_faults=for_driver(cfg),  # the cluster's past runs, for the cadence's rates
    )


def _tokenize_on_cluster(cfg: JobConfig) -> bool:
    """Ray Data on the cluster's CPUs for a corpus of several files (one task per file);
    one process here for a single file, and always under torchrun (no Ray there)."""
    from trainer.runtime.worker import is_torchrun_env

    mode = cfg.data.tokenize_on
    if mode == "driver" or is_torchrun_env():
        return False
    if mode == "cluster":
        return True
    import glob

    specs = [src.path for w in ("train", "eval") for src in cfg.data.sources(w)]
    many = any(
        s.startswith("s3://") or Path(s).is_dir() or len(glob.glob(s)) > 1 for s in specs if s
    )
    return many and bool(os.environ.get("RAY_ADDRESS"))


def data_settings(cfg: JobConfig) -> Settings:
    d = cfg.data
    return Settings(
        append_eos=d.append_eos,
        on_bad_line=d.on_bad_line,
        loss_on=d.loss_on,
        chat_template=read_chat_template(d.chat_template),
        long_rows=d.long_rows,
        block_size=d.block_size,
        endpoint=cfg.storage.endpoint_override,
        region=cfg.storage.region,
    )


def _rank0_selector(cfg: JobConfig) -> list[dict[str, str]] | None:
    """Per-worker label selectors that put rank 0 on a labelled node when the cluster has one
    alive or its autoscaler can launch one (trainer.autoscaling.placement); otherwise none."""
    want = cfg.scaling.rank0_label
    if not want:
        return None
    import ray

    from trainer.autoscaling.placement import launchable_labels, rank0_selector

    live = [n.get("Labels") or {} for n in ray.nodes() if n.get("Alive")]
    selector = rank0_selector(want, cfg.scaling.max_workers, live, launchable_labels())
    log.info(
        "rank 0 → a node labelled %s" if selector else "no node labelled %s; rank 0 placed freely",
        want,
    )
    return selector


def _connect_ray() -> None:
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise UserError(
                "no Ray cluster: submit with tools/submit.py (which sets RAY_ADDRESS), "
                "or run under torchrun"
            )
        ray.init(address=address, log_to_driver=True)


def check_nodes(cfg: JobConfig, report: preflight.Report, torchrun: bool) -> None:
    """What the config needs of the worker nodes themselves (a DeepSpeed NVMe offload's
    folder and async I/O op), probed on those nodes before tokenizing or launching."""
    if not report.deepspeed:
        return
    from trainer.strategies.deepspeed import config as dsconfig
    from trainer.strategies.deepspeed import nodes as dsnodes

    paths = dsconfig.nvme_paths(report.deepspeed)
    if not paths:
        return
    source = str(dsconfig.config_path(cfg.strategy.config))  # type: ignore[union-attr]
    if torchrun:
        dsnodes.check_here(paths, source)
    else:
        _connect_ray()
        dsnodes.check_ray_nodes(paths, source, cfg.scaling.use_gpu)


def launch_ray(cfg: JobConfig, prep: Prepared) -> dict[str, Any]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainer.runtime.entry import ray_worker

    _connect_ray()
    from trainer.checkpoint import memory
    from trainer.resilience.callbacks import FailureJournal, StopOnUserError
    from trainer.storage.retry import retrying

    run = run_location(cfg)
    cfg = memory.resolve_auto(cfg)  # the RAM tier's auto: on where the keepers fit
    resources = dict(cfg.scaling.resources_per_worker or {})
    scaling = ScalingConfig(
        num_workers=cfg.scaling.num_workers,
        use_gpu=cfg.scaling.use_gpu,
        resources_per_worker=resources or None,
        label_selector=_rank0_selector(cfg),
        elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
    )
    storage_root = run.path.rsplit("/", 1)[0]
    run_config = RunConfig(
        name=cfg.run.name,
        storage_path=storage_root,
        # On S3, Ray's own writes (its checkpoint registry) retry storage blips too.
        storage_filesystem=retrying(run.fs, cfg.checkpoint.upload_retry_s) if run.is_s3 else run.fs,
        failure_config=FailureConfig(
            max_failures=cfg.run.max_failures,
            max_preemption_failures=cfg.run.max_preemptions,
        ),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
        worker_runtime_env={"env_vars": _worker_env(cfg)},
        callbacks=[
            FailureJournal(
                cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region, cfg.run.name
            ),
            StopOnUserError(),
        ],
    )
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"job": cfg.model_dump(mode="json"), "prepared": asdict(prep)},
        scaling_config=scaling,
        run_config=run_config,
        torch_config=torch_config(cfg),
    )
    from trainer.resilience.journal import Journal

    Journal(run, f"driver-{int(time.time() * 1000)}").add(
        "driver", submission=os.environ.get("RAY_JOB_SUBMISSION_ID")
    )
    _record_job(cfg, run)
    watch = _watch(cfg, scaling, run)
    try:
        with _keepers(cfg, run.uri):
            result = trainer.fit()
    finally:
        watch.stop()
    summary = {
        "run": cfg.run.name,
        "storage": run.uri,
        "metrics": dict(result.metrics or {}),
        "checkpoint": _uri(run, result.checkpoint.path) if result.checkpoint else None,
        "export": _export_uri(run),
        "metrics_file": run.join("metrics.jsonl").uri,
    }
    _write_summary(run, summary)
    return summary


def _watch(cfg: JobConfig, scaling: Any, run: Any) -> Any:
    """The wait for the worker group's nodes, in the job's log, and the run's nodes, in its
    storage (trainer.autoscaling.watch)."""
    from trainer.autoscaling.watch import ClusterWatch, demand

    per_worker = dict(scaling._resources_per_worker_not_none)  # what Ray Train asks per worker
    need = demand(cfg.scaling.max_workers, per_worker, scaling.label_selector)
    workers = (cfg.scaling.min_workers, cfg.scaling.max_workers)
    source = f"driver-{int(time.time() * 1000)}"
    return ClusterWatch(need, workers, per_worker, run=run, source=source).start()


@contextlib.contextmanager
def _keepers(cfg: JobConfig, run_uri: str) -> Iterator[None]:
    """The RAM tier's keepers (trainer.checkpoint.memory) for as long as the run trains:
    started (or an earlier driver's reused) before the workers, ended however the run
    ends: finished, failed, or stopped (`raylift stop` sends the driver SIGTERM, then
    SIGKILL 3 s later: the handler ends the keepers at once, before fit() unwinds)."""
    from trainer.checkpoint import memory
    from trainer.planner.cadence import memory_tier_on

    if not memory_tier_on(cfg, ray_train=True):
        yield
        return
    import signal

    ns = memory.namespace(run_uri, cfg.run.name)

    def stopped(signum: int, frame: Any) -> None:
        # Ray's job stop sends SIGKILL 3 s after SIGTERM: end the keepers first, at once.
        memory.end_keepers(ns)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        memory.start_keepers(ns)
        yield
    finally:
        memory.end_keepers(ns)
        signal.signal(signal.SIGTERM, previous)


JOB_RECORD = "job.json"


def _record_job(cfg: JobConfig, run: Any) -> None:
    """The validated job and its model's parameter count, beside the run's records: what
    `raylift report` plans again to put the planner's estimate next to what the run cost
    (without reading the model there)."""
    from trainer.planner.shape import shape_for_job

    try:
        params: int | None = shape_for_job(cfg).params
    except Exception:  # an architecture the planner does not model: the record still helps
        params = None
    record = {"config": cfg.model_dump(mode="json"), "params": params}
    with run.fs.open_output_stream(run.join(JOB_RECORD).path) as f:
        f.write(json.dumps(record, indent=1).encode())


def _export_uri(run: Any) -> str | None:
    from trainer.checkpoint.manager import latest_export

    loc = latest_export(run)
    return loc.uri if loc is not None else None


def torch_config(cfg: JobConfig) -> Any:
    """Ray Train's process-group setup; oneCCL needs its bindings imported and its
    environment set on every worker before init_process_group (trainer.runtime.ccl)."""
    from ray.train.torch import TorchConfig

    if cfg.backend == "ccl":
        from trainer.runtime.ccl import OneCCLConfig

        return OneCCLConfig()
    return TorchConfig(backend=cfg.backend)


def _uri(run: Any, path: str) -> str:
    return "s3://" + path if run.is_s3 else path


def _worker_env(cfg: JobConfig | None = None) -> dict[str, str]:
    """What every Ray Train worker's environment gets from the driver's: the variables
    below, and the GPU allocator's setting (trainer.runtime.allocator)."""
    from trainer.runtime.allocator import allocator_env

    allocator = allocator_env(cfg) if cfg is not None else {}
    keep = (
        "RAYLIFT_DEBUG",
        "RAYLIFT_MODEL_CACHE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_EC2_METADATA_DISABLED",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "DS_ACCELERATOR",
        "TORCH_EXTENSIONS_DIR",
        "RAYLIFT_REBALANCE_FILE",  # where the node agent writes a rebalance notice
        *faults.WORKER_ENV,
    )
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **allocator}


def launch_torchrun(cfg: JobConfig, prep: Prepared) -> dict[str, Any]:
    from trainer.checkpoint.manager import find_latest
    from trainer.runtime.entry import torchrun_worker

    last = torchrun_worker(cfg, prep)
    run = run_location(cfg)
    latest = find_latest(run, allow_scratch=True)
    summary = {
        "run": cfg.run.name,
        "storage": run.uri,
        "metrics": last,
        "checkpoint": latest.uri if latest else None,
        "export": _export_uri(run),
        "metrics_file": run.join("metrics.jsonl").uri,
    }
    if int(os.environ.get("RANK", 0)) == 0:
        _write_summary(run, summary)
    return summary


def _write_summary(run: Any, summary: dict[str, Any]) -> None:
    loc = run.join("summary.json")
    run.fs.create_dir(run.path, recursive=True)
    with loc.fs.open_output_stream(loc.path) as f:
        f.write(json.dumps(summary, indent=2, default=str).encode())


def run_job(cfg: JobConfig) -> dict[str, Any]:
    from trainer.runtime.worker import is_torchrun_env
    from trainer.storage.hub import resolve_job

    cfg = resolve_job(cfg)  # Hub ids: fetched into shared storage, pinned, recorded

    torchrun = is_torchrun_env()
    rank = int(os.environ.get("RANK", 0)) if torchrun else 0
    if torchrun:
        from trainer.runtime.allocator import apply

        apply(cfg)  # this process is the worker: before anything starts CUDA
    report = preflight.run_all(cfg, strict=True)
    for note in report.notes:
        log.info("preflight: %s", note)
    check_nodes(cfg, report, torchrun)
    if torchrun and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # One process tokenizes; the others wait for its cache instead of racing it.
        prep = _prepare_rank0_first(cfg, rank)
        return launch_torchrun(cfg, prep)
    prep = prepare_inputs(cfg)
    return launch_torchrun(cfg, prep) if torchrun else launch_ray(cfg, prep)


def _prepare_rank0_first(cfg: JobConfig, rank: int) -> Prepared:
    import torch.distributed as dist

    from trainer.runtime.worker import init_process_group

    init_process_group(cfg.backend, minutes=60)
    if rank == 0:
        prep = prepare_inputs(cfg)
    dist.barrier()
    if rank != 0:
        prep = prepare_inputs(cfg, progress=False)
    return prep
