"""`python -m tools.evaluate RUN_OR_EXPORT --tasks ...`, the same as `raylift eval ...`."""

import sys

from tools.evaluate.cli import main

if __name__ == "__main__":
    sys.exit(main())
