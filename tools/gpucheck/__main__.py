"""`python -m tools.gpucheck` (what `make gpu-check` and `raylift gpu-check` run): the one
entry point of gpu-check; tools/gpucheck/driver.py has the whole story."""

from __future__ import annotations

import sys

from tools.gpucheck.driver import main

if __name__ == "__main__":
    sys.exit(main())
