"""A plan as text, and the planner's command-line arguments (shared by `python -m trainer plan`,
`tools/plan/` and the job CLI's refusal before submitting).
"""

from __future__ import annotations

from typing import Any

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.planner.catalog import get_instance
from trainer.planner.plan import Plan, plan_job
from trainer.planner.shape import DEFAULT_MFU, GIB, OFFLOAD_MFU, ShapeUnavailable, short_count

# ---------------------------------------------------------------- text output


def gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def adapter_lines(p: Plan) -> list[str]:
    """What LoRA trains, per kind of tensor, as the run's log prints it at start
    (trainer.model.adapters): a mixture of experts' plan without an `experts` row is an
    adapter that leaves the routed experts untrained."""
    s = p.setup
    if s.adapter == "none":
        return []
    kinds = p.shape.lora_by_kind(s.lora_r, list(s.lora_targets))
    parts = [f"{k} {short_count(n)} ({', '.join(names)})" for k, (n, names) in kinds.items()]
    return [f"adapters train: {'; '.join(parts) or 'nothing'}"]


def format_plan(p: Plan) -> str:
    """The plan as plain text (the trainer side prints this; tools/plan/ uses rich)."""
    s, r = p.setup, p.rank
    adapter = "" if s.adapter == "none" else f" + {s.adapter} r={s.lora_r} on "
    adapter += ",".join(s.lora_targets) if s.adapter != "none" else ""
    offload = []
    if s.fsdp_cpu_offload:
        offload.append("cpu_offload")
    if s.offload_optimizer != "none":
        offload.append(f"optimizer→{s.offload_optimizer}")
    if s.offload_param != "none":
        offload.append(f"params→{s.offload_param}")
    where = "GPU" if s.gpu else "host RAM"
    nvme_offload = "nvme" in (s.offload_optimizer, s.offload_param)
    lines = [
        f"model {short_count(p.params)} params ({short_count(p.trainable)} trainable), {s.strategy}"
        f"{adapter}{' ' + ', '.join(offload) if offload else ''}, {s.precision}, "
        f"{s.optimizer}, {s.world} workers, micro batch {s.micro_batch} × {s.block_size} "
        f"tokens, activation checkpointing {'on' if s.checkpointing else 'off'}, "
        f"{s.attention} attention",
        *adapter_lines(p),
        "",
        f"per rank ({where})",
        f"  weights            {gib(r.weights):>12}",
        f"  gradients          {gib(r.gradients):>12}",
        f"  optimizer states   {gib(r.optimizer):>12}",
        f"  activations        {gib(r.activations):>12}   "
        f"(checkpointing off {gib(r.activations_no_ckpt)}, on {gib(r.activations_ckpt)})",
        *memory_sum_lines(p),
        f"host RAM per rank: process {gib(p.host.process)}, offload {gib(p.host.offload)}, "
        f"load {gib(p.host.load)}, checkpoint staging {gib(p.host.staging)}; export on "
        f"rank 0's node {gib(p.host.export)}, staging on rank 0 {gib(p.host.staging_rank0)}",
    ]
    if p.host.keeper or p.host.keeper_node:
        lines.append(
            f"RAM tier keepers (checkpoint.memory_every): {gib(p.host.keeper)} per rank, "
            f"{gib(p.host.keeper_node)} once per node"
        )
    for title, lay in (("layout", p.layout), ("cheapest layout that fits", p.cheapest)):
        if lay is None:
            continue
        if lay is p.cheapest and same_layout(p.layout, lay):
            lines += ["", f"{title}: the layout above"]
            continue
        lines += ["", f"{title}: {lay.describe()}: {lay.verdict.upper()}"]
        lines.append(
            f"  {'node type':<22}{'count':>6}{'ranks':>6}  {'GPU need/have':>22}  "
            f"{'host need/have':>24}  {'local NVMe':>10}  verdict"
        )
        for n in lay.nodes:
            gpu = f"{gib(n.gpu_need)} / {n.gpu_capacity / GIB:.0f} GiB" if n.gpu_verdict else "-"
            host = f"{gib(n.host_need)} / {n.host_capacity / GIB:.0f} GiB"
            name = n.instance + (" (rank 0)" if n.rank0 else "")
            nvme = get_instance(n.instance).nvme_gb
            local = f"{nvme:,.0f} GB" if nvme else "none"
            lines.append(
                f"  {name:<22}{n.count:>6}{n.ranks_per_node:>6}  {gpu:>22}  {host:>24}  "
                f"{local:>10}  {n.verdict}"
            )
            if nvme_offload and not nvme:
                lines.append(
                    f"  ! {n.instance} has no instance-store NVMe: the DeepSpeed config's "
                    "nvme offload needs one at /mnt/local_storage on every node"
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


def same_layout(a: Any, b: Any) -> bool:
    """The chosen layout is also the cheapest: printed once."""
    if a is None or b is None:
        return False
    return (a.describe(), a.verdict, a.usd_per_hour) == (b.describe(), b.verdict, b.usd_per_hour)


def _g(x: float) -> str:
    return f"{x / GIB:.1f}"


def memory_sum_lines(p: Plan) -> list[str]:
    """The peak and how it is made from the parts: the tensors (the transient gradients and
    the activations do not peak together: the larger counts), then what the device holds
    beyond them (trainer.planner.device), each named, and the fit margin."""
    r = p.rank
    held = r.gradients_held
    tensors = (
        f"= weights {_g(r.weights)} + optimizer {_g(r.optimizer)} + held gradients {_g(held)} "
        f"+ max(gradients {_g(r.gradients - held)}, activations {_g(r.activations)})"
    )
    lines = [f"  tensors at peak    {gib(r.tensors):>12}   {tensors}"]
    if not r.device:
        lines.append(f"  process overhead   {gib(r.overhead):>12}   (torch, transformers, Ray)")
        lines.append(
            f"  total              {gib(r.total):>12}   = tensors {_g(r.tensors)} "
            f"+ process {_g(r.overhead)}"
        )
        return lines
    names = {
        "cuda_context": ("CUDA context", "context"),
        "nccl_buffers": ("NCCL buffers", "NCCL"),
        "cublas_workspaces": ("cuBLAS workspaces", "cuBLAS"),
        "allocator_slack": ("allocator slack", "slack"),
    }
    parts = [f"tensors {_g(r.tensors)}"]
    for key, value in r.device.items():
        label, short = names.get(key, (key, key))
        lines.append(f"  {label:<18} {gib(value):>12}   ({r.device_why.get(key, '')})")
        parts.append(f"{short} {_g(value)}")
    lines.append(f"  total              {gib(r.total):>12}   = " + " + ".join(parts))
    lines.append(
        f"  fit margin {p.margin:.0%} ({p.margin_why}): a GPU fits when the total is at most "
        f"{1 - p.margin:.0%} of it"
    )
    lines += [f"  {h}" for h in p.history]
    return lines


# ---------------------------------------------------------------- shared CLI arguments


def add_arguments(p: Any) -> None:
    """The planner's options, shared by `python -m trainer plan`, tools/plan/ and submit."""
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
    p.add_argument(
        "--calibration",
        help="a calibration file `make gpu-check` wrote (default: "
        "<storage.path>/_calibration/<GPU>.json when the storage path is local)",
    )


def plan_from_args(cfg: JobConfig, args: Any) -> Plan:
    def read_text(uri: str) -> str:
        from trainer.storage.location import read_text as read  # pyarrow: only for s3:// models

        return read(uri, cfg.storage.endpoint_override, cfg.storage.region)

    from trainer.planner import calibration as calib

    try:
        pool = get_instance(args.instance) if args.instance else None
        gpu_model = pool.gpu_model if pool is not None else None
        given = getattr(args, "calibration", None)
        st = cfg.storage
        found = (
            calib.read(given)
            if given
            else calib.find(st.path, gpu_model, st.endpoint_override, st.region)
        )
        shortfall, history = _history(cfg, gpu_model)
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
            calibration=found,
            history_shortfall=shortfall,
            history=history,
        )
    except KeyError as exc:  # an instance type the catalog does not have
        raise UserError(str(exc.args[0])) from None


def _history(cfg: JobConfig, gpu_model: str | None) -> tuple[float | None, list[str]]:
    """How past runs of this GPU kind and strategy under the job's storage path compared
    with their plans (trainer.planner.history)."""
    from trainer.planner import history
    from trainer.planner.memory import Setup

    if not cfg.scaling.use_gpu or not gpu_model:
        return None, []
    try:
        strategy = Setup.from_config(cfg).strategy
    except Exception:  # the plan itself reports what is wrong with the job
        return None, []
    st = cfg.storage
    try:
        runs = history.past_runs(st.path, gpu_model, strategy, st.endpoint_override, st.region)
    except history.Unreadable as exc:  # planned without history, and said so
        return None, [f"history: {exc}"]
    return history.assess(runs)


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
