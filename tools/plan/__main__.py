"""`python -m tools.plan job.yaml ...`, the same as `raylift plan job.yaml ...`."""

import sys

from tools.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
