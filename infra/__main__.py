"""Entry point for `pulumi up` (run from infra/); the program itself is infra/program.py."""

import sys
from pathlib import Path

# `pulumi up` runs this file with infra/ as the working directory; the program imports its
# own modules as the `infra` package, rooted at the repository root. Only `infra` is imported
# from there (tests/unit/test_import_rooms.py keeps it so): the instance catalog it shares
# with the planner is read as a data file (infra/catalog.py).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from infra.program import main  # noqa: E402

main()
