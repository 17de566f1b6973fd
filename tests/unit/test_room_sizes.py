"""Rooms that fit one head (issue 56), kept by a test rather than by review: a module in
trainer/ or tools/ longer than `LIMIT` lines either splits, or says in its docstring why it
is one idea, in a paragraph that begins with `MARKER` ("Why one module of about 700 lines:
it is one idea, ..."). Splitting is the better answer where a module holds two ideas."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500
MARKER = "Why one module"


def oversized_without_reason(*roots: Path) -> list[str]:
    """Each module over LIMIT lines whose docstring gives no reason, with its length."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n")
            if lines <= LIMIT:
                continue
            doc = ast.get_docstring(ast.parse(text, str(path))) or ""
            if not any(p.startswith(MARKER) for p in doc.split("\n\n")):
                found.append(f"{path.relative_to(root.parent)} ({lines} lines)")
    return found


def test_every_module_over_the_limit_says_why_it_is_one_idea() -> None:
    found = oversized_without_reason(ROOT / "trainer", ROOT / "tools")
    assert found == [], (
        f"modules over {LIMIT} lines: split each by idea, or begin a paragraph of its "
        f"docstring with {MARKER!r} saying why it is one idea: " + ", ".join(found)
    )


def test_the_rule_finds_a_long_module_and_accepts_its_reason(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "x = 1\n" * LIMIT
    (pkg / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (LIMIT - 1))
    (pkg / "long.py").write_text('"""Long, and says nothing of why."""\n' + body)
    (pkg / "mention.py").write_text(f'"""Long. Not a paragraph: {MARKER}."""\n' + body)
    (pkg / "reasoned.py").write_text(f'"""Long.\n\n{MARKER}: one idea."""\n' + body)
    assert oversized_without_reason(pkg) == [
        f"pkg/long.py ({LIMIT + 1} lines)",
        f"pkg/mention.py ({LIMIT + 1} lines)",
    ]
