"""Nothing leaves CI silently: every integration case marked `bench_only` (make bench runs
it, make test does not) is named in docs/development.md, with what still covers it in CI.
Read from the test files' syntax (a whole test, or one parameter set of it), without
importing them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_bench_only(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "bench_only"


def _param_id(call: ast.Call) -> str:
    return "-".join(str(a.value) for a in call.args if isinstance(a, ast.Constant))


def bench_only_cases(source: str, filename: str) -> list[str]:
    """`file::test` for a test marked bench_only, `file::test[id]` for one of its
    parameter sets (pytest.param(..., marks=pytest.mark.bench_only)). A fixture's
    parameter set names every test that uses the fixture."""
    tree = ast.parse(source)
    marked_params: dict[str, list[str]] = {}  # a fixture's name or a test's → its ids
    cases = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        if any(_is_bench_only(d) for d in fn.decorator_list):
            cases.append(f"{filename}::{fn.name}")
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            for kw in call.keywords:
                if kw.arg == "marks" and _is_bench_only(kw.value):
                    marked_params.setdefault(fn.name, []).append(_param_id(call))
    # params given in a module-level list (ADAPTERS = [pytest.param(...), ...])
    for assign in (n for n in tree.body if isinstance(n, ast.Assign)):
        for call in (n for n in ast.walk(assign) if isinstance(n, ast.Call)):
            if any(kw.arg == "marks" and _is_bench_only(kw.value) for kw in call.keywords):
                name = assign.targets[0].id if isinstance(assign.targets[0], ast.Name) else "?"
                marked_params.setdefault(name, []).append(_param_id(call))
    fixtures_of = {}  # a list's name or a fixture's → the fixtures parametrized by it
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for d in fn.decorator_list:
            for kw in getattr(d, "keywords", []):
                if kw.arg == "params" and isinstance(kw.value, ast.Name):
                    fixtures_of[kw.value.id] = fn.name
    ids_by_fixture = {fixtures_of.get(k, k): v for k, v in marked_params.items()}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        args = {a.arg for a in fn.args.args}
        for holder, ids in ids_by_fixture.items():
            if holder == fn.name or holder in args:
                cases += [f"{filename}::{fn.name}[{i}]" for i in ids if fn.name.startswith("test")]
    return sorted(set(cases))


def test_every_bench_only_integration_case_is_named_in_the_development_page() -> None:
    page = (ROOT / "docs" / "development.md").read_text()
    cases = [
        case
        for path in sorted((ROOT / "tests" / "integration").glob("test_*.py"))
        for case in bench_only_cases(path.read_text(), path.name)
    ]
    assert cases, "no bench_only integration case found: the scan is broken"
    assert [c for c in cases if f"`{c}`" not in page] == []


def test_the_scan_finds_a_marked_test_and_a_marked_fixture_parameter() -> None:
    source = """
import pytest
IDS = [pytest.param("a-b", marks=pytest.mark.bench_only), "c"]

@pytest.fixture(params=IDS)
def ref(request): ...

@pytest.mark.bench_only
def test_moved(): ...

def test_kept(ref): ...

@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.bench_only)])
def test_some(x): ...
"""
    assert bench_only_cases(source, "f.py") == [
        "f.py::test_kept[a-b]",
        "f.py::test_moved",
        "f.py::test_some[2]",
    ]
