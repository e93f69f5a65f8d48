"""Waiting for a shared machine to go quiet before a measured step, from a budget shared by the run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.compare.procstat import foreign_now

FOREIGN_LIMIT = 0.25
"""Default cores of other processes' CPU during a step above which the step counts as disturbed."""


@dataclass
class QuietBudget:
    """What the whole run may still spend on a shared box: seconds of waiting before steps, and
    repeats of disturbed steps. Mutable: every variant and step draws from the same budget."""

    wait_left: float
    retries_left: int


def wait_under(budget: QuietBudget, limit: float, measure: Callable[[float], float] = foreign_now,
               window_s: float = 3.0) -> tuple[float, float]:
    """Wait (from ``budget.wait_left``) until ``measure(window_s)`` reads at most ``limit`` cores; returns
    (seconds waited, the last reading). Bounded by the budget."""
    t0 = time.monotonic()
    reading = measure(window_s)
    while reading > limit and budget.wait_left > 0:
        budget.wait_left -= window_s
        reading = measure(window_s)
    return max(0.0, time.monotonic() - t0 - window_s), reading


def wait_quiet(budget: QuietBudget, limit: float, window_s: float = 3.0) -> dict[str, Any]:
    """Wait (from ``budget.wait_left``) until other processes use at most ``limit`` cores; returns how
    long it waited and the last reading. Bounded by the budget."""
    waited, reading = wait_under(budget, limit, foreign_now, window_s)
    return {"waited_s": round(waited, 1), "foreign_cores_at_start": round(reading, 3)}
