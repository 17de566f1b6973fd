"""The README stays short and the docs site stays whole: the config reference is generated
from the config models, every page is in the nav, and `mkdocs build --strict` passes (a
broken link or anchor fails here, not on the published site)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.configref import PAGE, page

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Measurements name their machine on the benchmarks page; development describes CI's.
MACHINE_PAGES = {"benchmarks.md", "development.md"}
MACHINE_WORDS = ("this machine", "this vm", "2-core", "firecracker")


def test_config_reference_is_current():
    assert PAGE == DOCS / "config-reference.md"
    assert PAGE.read_text() == page(), "run: python tools/configref.py --write"


def test_readme_leads_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text[text.index("```bash") : text.index("```", text.index("```bash") + 3)]
    assert "make demo" in first_block and "make test" in first_block


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250): move it to docs/"


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(on_disk - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - on_disk) == [], "nav entries with no page under docs/"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


def test_mkdocs_build_is_strict_clean(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: it belongs in the dev extra (make setup)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice, not ours
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def test_no_user_page_speaks_of_the_development_machine():
    pages = [ROOT / "README.md"] + [
        p for p in sorted(DOCS.rglob("*.md")) if p.name not in MACHINE_PAGES
    ]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {word!r}"
        for p in pages
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for word in MACHINE_WORDS
        if word in line.lower()
    ]
    assert found == [], "measurements and their machine belong in docs/benchmarks.md"
