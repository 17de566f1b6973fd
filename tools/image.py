#!/usr/bin/env python
"""Build, push and lock Raylift's training images, as described by images/graph.yaml.

    python tools/image.py build [--dry-run] [--only LAYER] [--variant gpu|cpu] [--registry R]
                                [--build-arg [NAME:]K=V ...] [--version V]
    python tools/image.py plan  (same options as build; prints the plan, needs no engine)
    python tools/image.py push  [--registry R] [--region R] [--dry-run] [--only ...]
    python tools/image.py lock  [--only NAME] [--check]

The tool itself is the package tools/imagetool (graph, buildplan, build, push, locks,
errors, cli: one concern per module); this file is its entry point for `make image` and
`make push` (and `raylift image`).
"""

from tools.imagetool.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
