"""A docs page's generated block: the text between two marker comments that a tool renders
from the code (tools/docgen/planfigures.py, tools/docgen/cadencefigures.py), so a figure
the docs quote cannot drift from what computes it. Each tool's unit test compares the page
with `page()`; `python -m tools.docgen.<tool> --write` rewrites the block, and with no flag
prints it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Block:
    page_path: Path
    begin: str
    end: str
    render: Callable[[], str]

    def page(self, text: str) -> str:
        """The page with its generated block replaced."""
        head, rest = text.split(self.begin, 1)
        _, tail = rest.split(self.end, 1)
        return f"{head}{self.begin}\n{self.render()}\n{self.end}{tail}"

    def main(self, argv: list[str], tool: str) -> int:
        if argv == ["--write"]:
            self.page_path.write_text(self.page(self.page_path.read_text()))
            print(f"wrote {self.page_path.relative_to(self.page_path.parents[1])}")
            return 0
        if argv:
            print(f"usage: python -m tools.docgen.{tool} [--write]", file=sys.stderr)
            return 2
        print(self.render())
        return 0
