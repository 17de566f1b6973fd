"""`python tools/configref.py [--write]`: the command docs/development.md gives for
regenerating docs/config-reference.md after a config change, kept at this path because
every developer runs it. The generator is tools/docgen/configref.py."""

import sys

from tools.docgen.configref import PAGE, main, page

__all__ = ["PAGE", "main", "page"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
