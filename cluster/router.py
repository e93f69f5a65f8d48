"""Request routing: which prefill and decode workers serve a request, from their live WorkerStats.

Policies are registered by name; ``round_robin`` and ``least_loaded`` need no model, ``goodput``
predicts TTFT/TPOT (see cluster/goodput.py when present). The router only reads stats, it never
waits on a worker.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.stats import WorkerStats

logger = logging.getLogger(__name__)


class RouteRequest(NamedTuple):
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    prefix_hash: int = 0


class RouteDecision(NamedTuple):
    admit: bool
    prefill: str | None  # worker id (None in colocated mode)
    decode: str | None  # worker id of the decode (or colocated) worker
    reason: str = ""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None


Policy = Callable[[RouteRequest, Sequence[WorkerStats], Sequence[WorkerStats]], RouteDecision]


def _load(s: WorkerStats) -> tuple[float, ...]:
    return (s.waiting + s.running, s.queued_prompt_tokens + s.running_context_tokens, s.kv_usage)


def least_loaded(req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]):
    p = min(prefill, key=lambda s: (s.waiting, s.queued_prompt_tokens, s.running)) if prefill else None
    d = min(decode, key=_load) if decode else None
    return RouteDecision(True, p.worker_id if p else None, d.worker_id if d else None, "least_loaded")


class RoundRobin:
    def __init__(self) -> None:
        self._p = itertools.count()
        self._d = itertools.count()

    def __call__(self, req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]):
        p = prefill[next(self._p) % len(prefill)].worker_id if prefill else None
        d = decode[next(self._d) % len(decode)].worker_id if decode else None
        return RouteDecision(True, p, d, "round_robin")


POLICIES: dict[str, Callable[[], Policy]] = {
    "least_loaded": lambda: least_loaded,
    "round_robin": RoundRobin,
}


def make_policy(name: str) -> Policy:
    if name == "goodput" and name not in POLICIES:
        try:
            import cluster.goodput  # noqa: F401  (registers itself)
        except ImportError:
            logger.warning("goodput policy unavailable; using least_loaded")
            return least_loaded
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
