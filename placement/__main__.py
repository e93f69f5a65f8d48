"""`python -m placement ...`: see placement.cli."""

from __future__ import annotations

import sys

from placement.cli import main

if __name__ == "__main__":
    sys.exit(main())
