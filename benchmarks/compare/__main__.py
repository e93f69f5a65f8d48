"""``python -m benchmarks.compare``."""

from __future__ import annotations

import sys

from benchmarks.compare.cli import main

sys.exit(main())
