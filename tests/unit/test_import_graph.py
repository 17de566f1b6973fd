"""The import graph as DESIGN.md draws it, kept by tests rather than by review.

- No import circles anywhere in trainer/ or tools/: no two modules import each other,
  directly or around a loop, function-level and TYPE_CHECKING imports included (grimp,
  import-linter's own graph library, reads every import statement in a file).
- docs/architecture.md draws the layers as they are: its table of trainer's packages lists
  what each imports today (an import of a package drawn above it marked ↑), and its table
  per layers contract in pyproject.toml lists the contract's layers, top first. A new
  package, module or import between packages fails here until the page says so.

The layers contracts themselves (a module importing from a layer above its own) are checked
by import-linter, in tests/unit/test_import_rooms.py; the contract over trainer's packages
(`trainer-layers`) follows the page's package table, top first, and is checked here too.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
ROOTS = ("trainer", "tools")
PACKAGES_HEADING = "### trainer/, package by package"
TRAINER_CONTRACT = "trainer-layers"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOTS, cache_dir=None)


def import_cycles(graph: grimp.ImportGraph, roots: Iterable[str] = ROOTS) -> list[list[str]]:
    """Every set of modules that import each other around a loop (strongly connected
    components of two or more), each sorted; iterative Tarjan, so a deep chain of imports
    cannot hit the recursion limit."""
    inside = sorted(m for m in graph.modules if m.partition(".")[0] in set(roots))
    edges = {
        m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in set(inside))
        for m in inside
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in inside:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = edges[node]
            if i < len(children):
                work.append((node, i + 1))
                child = children[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:  # back in the parent: carry the child's low link up
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def _describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    inner = [
        f"{a} -> {b}"
        for a in cycle
        for b in sorted(graph.find_modules_directly_imported_by(a))
        if b in cycle
    ]
    return "circle: " + "; ".join(inner)


def test_no_import_cycles_in_trainer_or_tools(graph):
    found = import_cycles(graph)
    assert found == [], (
        "modules import each other (move what both need down into the lower one, or into a "
        "small module of its own):\n" + "\n".join(_describe(graph, c) for c in found)
    )


def private_imports_across_packages(root: Path = ROOT / "trainer") -> list[str]:
    """Each `from trainer.X... import _name` in a module of another of trainer's packages:
    a package reaches another only through its public names (a private one may change
    with no warning to its importers, as planner.history's S3 reader did)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        here = path.relative_to(root.parent).with_suffix("").parts[:2]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            there = tuple(node.module.split(".")[:2])
            if there[0] == root.name and there != here:
                found += [
                    f"{path.relative_to(root.parent)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    return found


def test_no_package_imports_another_packages_private_names(tmp_path):
    assert private_imports_across_packages() == []
    # The finder itself, on a package whose `b` reaches into `a`'s private name.
    pkg = tmp_path / "trainer"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "mod.py").write_text("def _inner(): ...\n")
    (pkg / "a" / "use.py").write_text("from trainer.a.mod import _inner\n")  # its own: fine
    (pkg / "b" / "use.py").write_text("def f():\n    from trainer.a.mod import _inner, x\n")
    assert [f.split(": ", 1)[1] for f in private_imports_across_packages(pkg)] == [
        "trainer.a.mod._inner"
    ]


def test_the_cycle_finder_finds_a_circle_around_three_modules():
    """The finder itself, on a graph with a known loop (a -> b -> c -> a) beside a chain."""
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d", "p.e"):
        g.add_module(m)
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.e"), ("p.c", "p.d")):
        g.add_import(importer=a, imported=b)
    assert import_cycles(g, ["p"]) == [["p.a", "p.b", "p.c"]]
    g.remove_import(importer="p.c", imported="p.a")
    assert import_cycles(g, ["p"]) == []


# ---------------------------------------------------------------- docs/architecture.md


def _tables_under(heading: str) -> list[list[str]]:
    """The table rows (cells stripped, the header and its rule dropped) after `heading`,
    up to the next heading."""
    lines = PAGE.read_text().splitlines()
    assert heading in lines, f"{PAGE.name}: no heading {heading!r}"
    rows: list[list[str]] = []
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))  # \| is a pipe in a cell
            rows.append([c.strip() for c in cells])
    return rows[2:]  # the header row and the |---| rule


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _package_imports(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Each child of trainer (a package or a top-level module) and the children it
    imports, any of its modules counting."""
    out = {}
    for child in graph.find_children("trainer"):
        mods = {child} | graph.find_descendants(child)
        imported = {
            ".".join(x.split(".")[:2])
            for m in mods
            for x in graph.find_modules_directly_imported_by(m)
            if x.startswith("trainer.")
        }
        out[child.split(".")[1]] = {x.split(".")[1] for x in imported} - {child.split(".")[1]}
    return out


def test_the_architecture_page_lists_every_package_and_what_it_imports(graph):
    rows = _tables_under(PACKAGES_HEADING)
    order = [_names(r[0])[0] for r in rows]
    real = _package_imports(graph)
    assert sorted(order) == sorted(real), (
        f"{PAGE.name} '{PACKAGES_HEADING}': rows for {sorted(set(real) - set(order))} missing, "
        f"{sorted(set(order) - set(real))} no longer in trainer/"
    )
    cells = expected_cells(graph)
    for row in rows:
        name = _names(row[0])[0]
        assert row[2] == cells[name], (
            f"{PAGE.name}: the row of `{name}` says it imports {row[2]}; the code imports "
            f"{cells[name]} (↑: a package drawn above it); if that is meant: "
            "python tests/unit/test_import_graph.py --write"
        )
        assert row[1], f"{PAGE.name}: the row of `{name}` has no role"


def _layers_contracts() -> list[dict]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in conf["contracts"] if c["type"] == "layers"]


def test_the_architecture_page_draws_each_layers_contract():
    contracts = [c for c in _layers_contracts() if c["id"] != TRAINER_CONTRACT]
    assert {c["id"] for c in contracts} >= {"planner-layers", "model-layers", "strategies-layers"}
    for c in contracts:
        (container,) = c["containers"]
        heading = f"### `{container}` (contract `{c['id']}`)"
        rows = _tables_under(heading)
        drawn = [sorted(_names(r[0])) for r in rows]
        want = [sorted(m.strip() for m in layer.split("|")) for layer in c["layers"]]
        assert drawn == want, (
            f"{PAGE.name} {heading}: layers drawn {drawn}, the contract's are {want}"
        )
        assert all(r[1] for r in rows), f"{PAGE.name} {heading}: a layer has no role"


def test_the_trainer_layers_contract_draws_the_packages_in_the_pages_order(graph):
    """The contract over trainer's packages (one a layer, top first) and the page's package
    table are one order: a package moved on the page moves in the contract, and a package
    the code has must be in both. An optional layer, "(name)", is one not yet in trainer/."""
    (contract,) = [c for c in _layers_contracts() if c["id"] == TRAINER_CONTRACT]
    assert contract["containers"] == ["trainer"] and contract["exhaustive"]
    real = set(_package_imports(graph))
    layers = [layer.strip() for layer in contract["layers"]]
    assert all("|" not in layer for layer in layers), "one package a layer, as the page draws"
    named = [layer.strip("()") for layer in layers]
    present = [n for n, layer in zip(named, layers, strict=True) if n in real]
    assert not [n for n, layer in zip(named, layers, strict=True) if n not in real and layer == n]
    drawn = [_names(r[0])[0] for r in _tables_under(PACKAGES_HEADING)]
    assert present == drawn, (
        f"pyproject.toml's {TRAINER_CONTRACT} layers {present} differ from the order of "
        f"{PAGE.name} '{PACKAGES_HEADING}': {drawn}"
    )


def expected_cells(graph: grimp.ImportGraph) -> dict[str, str]:
    """The imports cell each row of the page's package table should have, in the page's
    order (a package not on the page yet is listed last, to be placed by hand)."""
    real = _package_imports(graph)
    order = [_names(r[0])[0] for r in _tables_under(PACKAGES_HEADING)]
    order = [n for n in order if n in real] + sorted(set(real) - set(order))
    cells = {}
    for i, name in enumerate(order):
        above = set(order[:i])
        want = sorted(f"`{x}`" for x in real[name] - above) + sorted(
            f"↑`{x}`" for x in real[name] & above
        )
        cells[name] = " ".join(want) or "nothing"
    return cells


def write_cells(cells: dict[str, str]) -> None:
    """Rewrite the imports cell of each row the page already has (roles and order stay
    the page's: a new package's row is written by hand, with its role)."""
    lines = PAGE.read_text().splitlines(keepends=True)
    start = lines.index(PACKAGES_HEADING + "\n")
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("#"):
            break
        names = _names(lines[i].split("|")[1]) if lines[i].startswith("| `") else []
        if names and names[0] in cells:
            head = lines[i].rstrip().rstrip("|").rstrip()
            lines[i] = head[: head.rindex("|") + 1] + f" {cells[names[0]]} |\n"
    PAGE.write_text("".join(lines))


if __name__ == "__main__":  # `--write`: the page's imports cells from the code
    import sys

    cells = expected_cells(grimp.build_graph(*ROOTS, cache_dir=None))
    if "--write" in sys.argv:
        write_cells(cells)
    for name, cell in cells.items():
        print(f"{name}: {cell}")
