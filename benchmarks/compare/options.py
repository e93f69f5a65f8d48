"""The knobs of one comparison run, the same for every variant it deploys."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare.quiet import FOREIGN_LIMIT, STEAL_LIMIT
from benchmarks.serve import ProgressFn
from benchmarks.stats import SLO, CostModel

logger = logging.getLogger(__name__)


def _log(line: str) -> None:
    logger.info("%s", line)


@dataclass(frozen=True)
class RunOptions:
    slo: SLO
    request_timeout_s: float = 120.0
    cost: CostModel | None = None
    """Gives every step's summary $/M input and output tokens."""
    foreign_limit: float = FOREIGN_LIMIT
    """Cores other processes may use during a step before it counts as disturbed (and is repeated)."""
    steal_limit: float = STEAL_LIMIT
    """Cores the host may steal during a step before it counts as disturbed (and is repeated)."""
    reset_affinity: bool = True
    """Re-allow every engine thread on every CPU after deploy (see benchmarks/compare/affinity.py)."""
    probe_requests: int = 5
    """Sequential requests on the idle deployment before the steps (0: none)."""
    probe_input_len: int = 512
    """Prompt tokens of each probe request (the CLI: the workload's median input)."""
    quality: bool = True
    """Greedy outputs of the eval set from each variant's endpoint."""
    quality_prompts: int | None = None
    """Only the eval set's first prompts (None: all of them)."""
    extra: Callable[[str, str], dict[str, Any]] | None = None
    """A measurement of the ready, idle deployment (endpoint, model) -> its figures, kept as the variant's
    ``extra`` (e.g. task accuracy); after the greedy eval set, before the steps."""
    ready_timeout_s: float = 300.0
    warmup_requests: int = 2
    """Before a variant's first step (not measured)."""
    out_dir: Path | None = None
    """Each variant's plain benchmark report (every request) goes to ``out_dir / name``."""
    prog: str = "python -m benchmarks.compare"
    """Named in each variant's benchmark report as the command that made it."""
    progress: ProgressFn | None = None
    say: Callable[[str], None] = field(default=_log)
    """Where the run's progress lines go (a CLI prints them)."""
