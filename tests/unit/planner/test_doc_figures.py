"""docs/production.md quotes the planner for its example 7B job: the paragraph is generated
from the planner (tools/docgen/planfigures.py), so a formula change that moves a figure fails here
until the page is rewritten, as the config reference is kept."""

from __future__ import annotations

from tools.docgen import planfigures


def test_production_figures_are_the_planners():
    text = planfigures.PAGE.read_text()
    assert text.count(planfigures.BEGIN) == 1 and text.count(planfigures.END) == 1
    assert text == planfigures.page(text), "run: python -m tools.docgen.planfigures --write"


def test_the_paragraph_names_every_part_of_the_total():
    p = planfigures.production_plan()
    para = " ".join(planfigures.production_paragraph().split())
    assert f"puts it at {p.rank.total / 2**30:.1f} GiB per GPU" in para
    for part in ("sharded state", "activations", "CUDA context", "NCCL", "cuBLAS", "slack"):
        assert part in para
