"""The README's config reference is generated from the config models; keep them equal."""

from __future__ import annotations

from pathlib import Path

from tools.configref import BEGIN, END, reference

ROOT = Path(__file__).resolve().parents[2]


def test_readme_config_reference_is_current():
    text = (ROOT / "README.md").read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:stop] == reference(), "run: python tools/configref.py and paste it"


def test_readme_leads_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text[text.index("```bash") : text.index("```", text.index("```bash") + 3)]
    assert "make demo" in first_block and "make test" in first_block
