"""Baseline policies that need no latency model: least loaded and round robin. Both admit everything."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cluster.router.policy import Policy, RouteDecision, RouteRequest, register
from engine.contract import WorkerStats


def _load(s: WorkerStats) -> tuple[float, ...]:
    # NOTE: a decode worker's prompts pulling KV count as context there (they are not in queued_prompt_tokens)
    return (s.waiting + s.running, s.queued_prompt_tokens + s.pulling_tokens + s.running_context_tokens,
            s.kv_usage)


class LeastLoaded(Policy):
    """Prefill: fewest waiting requests and queued prompt tokens; decode: smallest batch and context."""

    def route(self, req: RouteRequest, prefill: Sequence[WorkerStats],
              decode: Sequence[WorkerStats]) -> RouteDecision:
        p = min(prefill, key=lambda s: (s.waiting, s.queued_prompt_tokens, s.running)) if prefill else None
        d = min(decode, key=_load) if decode else None
        return RouteDecision(True, p.worker_id if p else None, d.worker_id if d else None, "least_loaded")


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._p = itertools.count()
        self._d = itertools.count()

    def route(self, req: RouteRequest, prefill: Sequence[WorkerStats],
              decode: Sequence[WorkerStats]) -> RouteDecision:
        p = prefill[next(self._p) % len(prefill)].worker_id if prefill else None
        d = decode[next(self._d) % len(decode)].worker_id if decode else None
        return RouteDecision(True, p, d, "round_robin")


least_loaded = LeastLoaded()  # NOTE: stateless, so one instance serves every caller
register("least_loaded")(lambda **_: least_loaded)
register("round_robin")(lambda **_: RoundRobin())
