"""The `raylift data` command line: parse, run the preview, print one-line errors."""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from trainer.objectives.preview import add_arguments, run

    p = argparse.ArgumentParser(
        prog="raylift data",
        description="Each source's shape, counts and first rows as tokens, trained ones marked.",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    try:
        return run(args, sys.stdout)
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
