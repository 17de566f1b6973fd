"""DeepSpeed JSON configs: the stock Hugging Face / Ray-template convention of `"auto"`
values, filled from the job config. A value that is set and contradicts the job config is
an error naming both, so there is one source of truth for batch sizes, clipping and the
optimizer. Pure (json only): it runs on the laptop in preflight and again on workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config import JobConfig
from trainer.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent / "templates"


def config_path(name: str) -> Path:
    """A shipped config by name (zero2, zero3, zero3_offload) or a path to a JSON file."""
    shipped = SHIPPED / f"{name}.json"
    if "/" not in name and not name.endswith(".json"):
        if not shipped.exists():
            names = sorted(p.stem for p in SHIPPED.glob("*.json"))
            raise ConfigError(f"strategy.config: {name!r} is not a shipped config ({names})")
        return shipped
    return Path(name).expanduser()


def load(name: str) -> tuple[dict[str, Any], str]:
    path = config_path(name)
    try:
        return json.loads(path.read_text()), str(path)
    except FileNotFoundError:
        raise ConfigError(f"strategy.config: {path} not found") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None


def resolve(
    ds: dict[str, Any], cfg: JobConfig, source: str, hidden_size: int | None = None
) -> dict[str, Any]:
    """Return a copy of `ds` with every "auto" filled from the job; raise ConfigError when a
    set value contradicts it. `hidden_size` fills the ZeRO bucket sizes (the HF rules)."""
    ds = json.loads(json.dumps(ds))
    t, o = cfg.train, cfg.optim

    def fill(node: dict[str, Any], key: str, want: Any, job_field: str, where: str) -> None:
        if key not in node or node[key] == "auto":
            node[key] = want
            return
        have = node[key]
        if not _same(have, want):
            raise ConfigError(
                f"{source}: {where}{key} is {have!r} but the job has {job_field} = {want!r}; "
                f'set it to "auto" (or to {want!r}), or change {job_field}'
            )

    fill(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size", "")
    fill(ds, "gradient_accumulation_steps", t.grad_accum, "train.grad_accum", "")
    # DeepSpeed counts micro batches × every worker; under strategy.sp a group's sp
    # workers share each row (trainer.parallel.sequence), so its count is sp × the rows'.
    sp = cfg.strategy.sp
    batch, named = cfg.global_batch * sp, "the global batch" + (f" × strategy.sp {sp}" * (sp > 1))
    fill(ds, "train_batch_size", batch, named, "")
    fill(ds, "gradient_clipping", float(o.grad_clip or 0.0), "optim.grad_clip", "")
    for key, enabled in (("bf16", t.precision == "bf16"), ("fp16", t.precision == "fp16")):
        if key in ds:
            fill(ds[key], "enabled", enabled, f"train.precision == {key}", f"{key}.")
    if "optimizer" in ds:
        opt = ds["optimizer"]
        if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
            raise ConfigError(
                f"{source}: optimizer.type {opt.get('type')!r}: only AdamW is supported "
                "(the job's optim section describes it)"
            )
        p = opt.setdefault("params", {})
        fill(p, "lr", float(o.lr), "optim.lr", "optimizer.params.")
        fill(p, "betas", list(o.betas), "optim.betas", "optimizer.params.")
        fill(p, "eps", float(o.eps), "optim.eps", "optimizer.params.")
        fill(p, "weight_decay", float(o.weight_decay), "optim.weight_decay", "optimizer.params.")
    if "scheduler" in ds:
        raise ConfigError(
            f"{source}: remove the scheduler block; the job's optim.schedule and "
            "optim.warmup_steps drive the learning rate under every strategy"
        )
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage") not in (2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage must be 2 or 3")
    for key, value in _bucket_sizes(hidden_size).items():
        if zero.get(key) == "auto":
            if value is None:
                continue  # filled on the worker, where the model's config is read
            zero[key] = value
    return ds


def _same(have: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    if isinstance(want, int | float) and isinstance(have, int | float):
        return abs(have - want) <= 1e-12 * max(1.0, abs(want))
    if isinstance(want, list) and isinstance(have, list) and len(have) == len(want):
        return all(_same(h, w) for h, w in zip(have, want, strict=True))
    return bool(have == want)


def _bucket_sizes(hidden: int | None) -> dict[str, int | None]:
    if hidden is None:
        return dict.fromkeys(
            (
                "reduce_bucket_size",
                "allgather_bucket_size",
                "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold",
            )
        )
    return {
        "reduce_bucket_size": hidden * hidden,
        "allgather_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


def stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision(ds: dict[str, Any]) -> str:
    """The engine's compute precision as train.precision names it (bf16, fp16 or fp32)."""
    for key in ("bf16", "fp16"):
        if ds.get(key, {}).get("enabled") is True:
            return key
    return "fp32"


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def offload_device(ds: dict[str, Any], which: str) -> str:
    """`which` is offload_optimizer or offload_param; "none" when absent."""
    node = ds.get("zero_optimization", {}).get(which) or {}
    return str(node.get("device") or "none").lower()


def client_optimizer(ds: dict[str, Any]) -> str | None:
    """The optimizer Raylift builds for a JSON without an `optimizer` section (the Ray
    template builds it in code): DeepSpeed's CPU Adam where the optimizer state lives in
    CPU RAM or on NVMe (DeepSpeed refuses any other client optimizer there, and its C++
    Adam is what it would build itself), torch's AdamW otherwise. None when the JSON
    names its optimizer and DeepSpeed builds it."""
    if "optimizer" in ds:
        return None
    return "cpu_adam" if offload_device(ds, "offload_optimizer") in ("cpu", "nvme") else "adamw"


def nvme_paths(ds: dict[str, Any]) -> dict[str, str]:
    """{"zero_optimization.offload_x.nvme_path": path} for every part offloaded to NVMe."""
    zero = ds.get("zero_optimization", {})
    return {
        f"zero_optimization.{which}.nvme_path": str(zero[which].get("nvme_path") or "")
        for which in ("offload_optimizer", "offload_param")
        if offload_device(ds, which) == "nvme"
    }


def check(ds: dict[str, Any], source: str) -> None:
    """Refuse a resolved config that cannot run, before any worker starts: one line naming
    the file, the key and the fix. Pure, so the driver (and a laptop) runs it without a
    GPU; what needs the worker nodes (NVMe paths, the async I/O op)
    is `nodes`'."""
    for key, value in _leaves(ds):
        if value == "auto":
            raise ConfigError(
                f'{source}: {key} is "auto" but the job has nothing to fill it from; set a value'
            )
    zero = ds.get("zero_optimization", {})
    for which in ("offload_optimizer", "offload_param"):
        device = offload_device(ds, which)
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(
                f"{source}: zero_optimization.{which}.device is {device!r}; use one of "
                f"{', '.join(OFFLOAD_DEVICES)}"
            )
    if offload_device(ds, "offload_param") != "none" and stage(ds) != 3:
        raise ConfigError(
            f"{source}: zero_optimization.offload_param needs stage 3 (this file has stage "
            f"{zero.get('stage')}); set stage to 3 or remove offload_param"
        )
    for key, path in nvme_paths(ds).items():
        if not path:
            raise ConfigError(
                f"{source}: {key} is not set but the device is nvme; set it to a local NVMe "
                "folder on every worker node, or use device cpu"
            )


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        out: list[tuple[str, Any]] = []
        for k, v in node.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, node)]
