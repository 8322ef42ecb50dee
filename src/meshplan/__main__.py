"""`python -m meshplan ...` runs the `meshplan` command line."""
from __future__ import annotations

import sys

from meshplan.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
