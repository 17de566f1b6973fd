"""`raylift plan`'s tables: the plan as rich tables (memory per rank and how each line is
made, the layout and the cheapest layout that fits, each node type's verdict), or the
planner's plain text where rich is not installed. Drawing only; the figures are
trainer.planner's."""

from __future__ import annotations

from trainer.planner.plan import Layout, Plan
from trainer.planner.report import format_plan, memory_sum_lines, same_layout
from trainer.planner.shape import GIB

_STYLE = {"fits": "green", "tight": "yellow", "does not fit": "bold red"}


def render(plan: Plan) -> None:
    """Rich tables when rich is installed (the tools extra), else the plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plan(plan))
        return
    console = Console()
    head = format_plan(plan).split("\n\n", 1)[0]
    console.print(head, markup=False, highlight=False)
    r = plan.rank
    mem = Table(title="per rank (GPU)" if plan.setup.gpu else "per rank (host RAM)")
    mem.add_column("part")
    mem.add_column("GiB", justify="right")
    rows = [
        ("weights", r.weights),
        ("gradients", r.gradients),
        ("optimizer states", r.optimizer),
        (f"activations (checkpointing {'on' if r.checkpointing else 'off'})", r.activations),
        ("  if checkpointing off", r.activations_no_ckpt),
        ("  if checkpointing on", r.activations_ckpt),
    ]
    mem.add_column("made of")
    for name, value in rows:
        mem.add_row(name, f"{value / GIB:.1f}", "")
    # The peak, the device lines and the total, each with how it is made (the plain text's).
    for line in memory_sum_lines(plan):
        label, _, rest = line.strip().partition("  ")
        figure, _, why = rest.strip().partition("   ")
        if figure.endswith("GiB"):
            mem.add_row(label, figure.removesuffix(" GiB").strip(), why.strip(), end_section=False)
        else:
            mem.caption = (mem.caption + "\n" if mem.caption else "") + line.strip()
    console.print(mem)
    for title, lay in (("layout", plan.layout), ("cheapest layout that fits", plan.cheapest)):
        if lay is plan.cheapest and same_layout(plan.layout, lay):
            console.print(f"{title}: the layout above", markup=False, highlight=False)
        elif lay is not None:
            console.print(_layout_table(title, lay, plan.tokens_per_epoch))
    if plan.layout is None and plan.cheapest is None and plan.setup.gpu:
        console.print("[bold red]no catalog layout fits this job at up to 64 workers")
    for note in plan.notes:
        console.print(f"note: {note}", markup=False, highlight=False)


def _layout_table(title: str, lay: Layout, tokens: int | None) -> object:
    from rich.table import Table

    caption = f"${lay.usd_per_hour:.2f}/h on demand, ${lay.spot_usd_per_hour:.2f}/h on spot"
    if lay.tokens_per_s:
        caption += f"; {lay.tokens_per_s:,.0f} tokens/s ({lay.tokens_per_s_source})"
    e = lay.epoch(tokens)
    if e:
        caption += (
            f"; epoch: {e['hours']:.2f} h, ${e['usd_on_demand']:.2f} on demand, "
            f"${e['usd_spot']:.2f} on spot"
        )
    t = Table(
        title=f"{title}: {lay.describe()}: [{_STYLE[lay.verdict]}]{lay.verdict}",
        caption=caption,
    )
    for col in ("node type", "count", "ranks", "GPU need / have", "host need / have", "verdict"):
        t.add_column(col, justify="left" if col in ("node type", "verdict") else "right")
    for n in lay.nodes:
        gpu = f"{n.gpu_need / GIB:.1f} / {n.gpu_capacity / GIB:.0f}" if n.gpu_verdict else "-"
        t.add_row(
            n.instance + (" (rank 0)" if n.rank0 else ""),
            str(n.count),
            str(n.ranks_per_node),
            gpu,
            f"{n.host_need / GIB:.1f} / {n.host_capacity / GIB:.0f}",
            f"[{_STYLE[n.verdict]}]{n.verdict}",
        )
    return t
