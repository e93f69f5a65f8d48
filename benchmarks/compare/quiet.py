"""Waiting for a shared machine to go quiet before a measured step, from a budget shared by the run."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.compare.procstat import foreign_now, quiet_now

FOREIGN_LIMIT = 0.25
"""Default cores of other processes' CPU during a step above which the step counts as disturbed."""
STEAL_LIMIT = 0.1
"""Default cores the hypervisor may take for other guests (steal) during a step before it counts as disturbed.
NOTE: on a shared VM steal slows every engine as much as foreign load does, but shows in no process's CPU time;
on the 2-core box of 2026-12-06 it reached 0.36 cores in a step (median 0.03 over 60 steps)."""


@dataclass
class QuietBudget:
    """What the whole run may still spend on a shared box: seconds of waiting before steps, and
    repeats of disturbed steps. Mutable: every variant and step draws from the same budget."""

    wait_left: float
    retries_left: int


def _wait(budget: QuietBudget, measure: Callable[[float], Any], busy: Callable[[Any], bool],
          window_s: float) -> tuple[float, Any]:
    """Wait (from ``budget.wait_left``) while ``busy(measure(window_s))``; returns (seconds waited, the last
    reading). Bounded by the budget."""
    t0 = time.monotonic()
    reading = measure(window_s)
    while busy(reading) and budget.wait_left > 0:
        budget.wait_left -= window_s
        reading = measure(window_s)
    return max(0.0, time.monotonic() - t0 - window_s), reading


def wait_under(budget: QuietBudget, limit: float, measure: Callable[[float], float] = foreign_now,
               window_s: float = 3.0) -> tuple[float, float]:
    """Wait (from ``budget.wait_left``) until ``measure(window_s)`` reads at most ``limit`` cores; returns
    (seconds waited, the last reading). Bounded by the budget."""
    return _wait(budget, measure, lambda cores: cores > limit, window_s)


def wait_quiet(budget: QuietBudget, limit: float, steal_limit: float = STEAL_LIMIT, window_s: float = 3.0,
               measure: Callable[[float], tuple[float, float]] = quiet_now) -> dict[str, Any]:
    """Wait (from ``budget.wait_left``) until other processes use at most ``limit`` cores and the host steals at
    most ``steal_limit`` (``measure(window_s)``: both over a window); returns how long it waited and the last
    readings. Bounded by the budget."""
    waited, (foreign, steal) = _wait(budget, measure, lambda r: r[0] > limit or r[1] > steal_limit, window_s)
    return {"waited_s": round(waited, 1), "foreign_cores_at_start": round(foreign, 3),
            "steal_cores_at_start": round(steal, 3)}


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    """--quiet-wait and --retries (a run's QuietBudget), for every benchmark CLI that replays steps."""
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="seconds in all the run may wait, before steps, for other processes and host steal to "
                             "drop under their limits")
    parser.add_argument("--retries", type=int, default=2,
                        help="disturbed steps the run may repeat in all (the cleanest attempt is kept)")


def lost_cores(resources: dict[str, Any]) -> float:
    """Cores a step lost to what is not ours: other processes' CPU plus the host's steal."""
    return (resources.get("machine_other_cores") or 0.0) + (resources.get("machine_steal_cores") or 0.0)


def disturbed(resources: dict[str, Any], foreign_limit: float, steal_limit: float) -> bool:
    """Whether a step's measurement is not of our system alone: foreign CPU or host steal over its limit."""
    return ((resources.get("machine_other_cores") or 0.0) > foreign_limit
            or (resources.get("machine_steal_cores") or 0.0) > steal_limit)
