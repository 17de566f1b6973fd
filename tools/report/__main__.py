"""`python -m tools.report STORAGE_PATH/RUN_NAME`, the same as `raylift report ...`."""

import sys

from tools.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
