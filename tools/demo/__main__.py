"""`python -m tools.demo` (what `make demo` runs), the same as `raylift demo`."""

import sys

from tools.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
