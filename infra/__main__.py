"""Entry point for `pulumi up` (run from infra/); the program itself is infra/program.py."""

import sys
from pathlib import Path

# `pulumi up` runs this file with infra/ as the working directory; the program imports the
# `infra` package and the shared `trainer.catalog`, both rooted at the repository root. An
# editable install (`pip install -e '.[infra]'`) makes this a no-op.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from infra.program import main  # noqa: E402

main()
