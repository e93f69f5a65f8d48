"""Admission: ask the policy for a route; when it says no, queue (only while the request's own TTFT budget
can still be met, bounded), refuse with 429, or serve anyway, as `router.admission` says. Also waits
(bounded) for a pool that has no healthy worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from cluster.config import RouterConfig
from cluster.errors import rate_limited, unavailable
from cluster.router.policy import Policy, PoolSource, RouteDecision, RouteRequest

POLL_S = 0.05  # how often a queued request asks the policy again


class Admission:
    def __init__(self, policy: Policy, membership: PoolSource, router_cfg: RouterConfig, *,
                 colocated: bool, recovery_timeout_s: float,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self.policy = policy
        self.members = membership
        self.cfg = router_cfg
        self.colocated = colocated
        self.recovery_timeout_s = recovery_timeout_s
        self._on_wait = on_wait or (lambda s: None)
        self.queued = 0  # requests of this ingress waiting for admission

    async def route(self, req: RouteRequest, exclude: set[str] | frozenset[str] = frozenset(),
                    must_admit: bool = False) -> RouteDecision:
        """Pick workers, applying admission. ``must_admit`` (retries of a request already admitted)
        skips admission but still waits for a healthy worker, up to serve.recovery_timeout_s."""
        t0 = time.monotonic()
        rc = self.cfg
        queued = False
        try:
            while True:
                prefill, decode = self.members.pools(exclude)
                waited = time.monotonic() - t0
                if not decode or not (prefill or self.colocated):
                    if waited > self.recovery_timeout_s:
                        raise unavailable("no healthy workers in the pools; retry later")
                    await asyncio.sleep(0.1)
                    continue
                if queued and rc.admission == "queue" and req.ttft_slo_s - waited <= 0:
                    raise rate_limited(f"TTFT target of {req.ttft_slo_s * 1000:.0f} ms passed while queued; "
                                       "retry later", code="slo_unattainable")
                d = self.policy(req._replace(ttft_slo_s=req.ttft_slo_s - waited), prefill, decode)
                if d.admit or must_admit or rc.admission == "best_effort":
                    if not self.colocated and not d.local and rc.disaggregation == "never":
                        # NOTE: a policy without a local-prefill model (the baselines): its decode worker
                        d = d._replace(prefill=None, local=True, placement="local:never")
                    return d._replace(admit=True)
                budget = req.ttft_slo_s - waited
                # NOTE: queue only while waiting can help: a TTFT that is predicted past the budget even
                # counting the queue ahead only grows by waiting; refused now, the client can go elsewhere.
                if rc.admission == "reject" or (d.predicted_ttft_s is not None and d.predicted_ttft_s > budget):
                    raise rate_limited(f"no worker can meet the SLO now ({d.reason}); retry later",
                                       code="slo_unattainable")
                if not queued:
                    if self.queued >= rc.max_queue:
                        raise rate_limited(f"admission queue full ({rc.max_queue} waiting); retry later",
                                           code="queue_full")
                    self.queued += 1
                    queued = True
                if waited > rc.queue_timeout_s:
                    raise rate_limited(f"not admitted within {rc.queue_timeout_s:.0f}s; retry later",
                                       code="queue_timeout")
                await asyncio.sleep(POLL_S)
        finally:
            if queued:
                self.queued -= 1
            self._on_wait(time.monotonic() - t0)
