"""The pools as one ingress replica sees them: worker handles and roles from the PoolController, and
every worker's WorkerStats refreshed in the background (what the routing policy reads)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from cluster.router.policy import Pools
from cluster.serve import workers
from engine.contract import WorkerStats

logger = logging.getLogger(__name__)

IDLE_STATS_INTERVAL_S = 1.0  # worker stats refresh period while nothing is in flight
MEMBERS_TIMEOUT_S = 10.0


class Member(NamedTuple):
    worker_id: str
    role: str  # prefill | decode | colocated
    handle: Any  # the worker's Ray actor handle


class Membership:
    """`handles`/`roles` follow the controller's membership version; `stats` the workers' own snapshots.

    `on_pool_sizes(role, n)` and `on_stats(WorkerStats)` let the caller export gauges; `busy()` tells
    whether requests are in flight (stats refresh every `interval_s` then, every second otherwise,
    and `wake()` ends an idle wait at once)."""

    def __init__(self, controller: Any, mode: str, interval_s: float, busy: Callable[[], bool], *,
                 on_pool_sizes: Callable[[str, int], None] | None = None,
                 on_stats: Callable[[WorkerStats], None] | None = None) -> None:
        self.controller = controller
        self.mode = mode
        self.interval_s = interval_s
        self._busy = busy
        self._on_pool_sizes = on_pool_sizes or (lambda role, n: None)
        self._on_stats = on_stats or (lambda s: None)
        self._on_calibration: Callable[[Any], None] | None = None
        self.calibration: Any = None  # the controller's Calibration (or its failure text) once published
        self._calibration_version = 0
        self.calibration_final = False
        self._calibration_asked = False
        self.handles: dict[str, Any] = {}
        self.roles: dict[str, str] = {}
        self.stats: dict[str, WorkerStats] = {}
        self.version = -1
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._members_loop()), loop.create_task(self._stats_loop())]

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    def enable_calibration(self, on_calibration: Callable[[Any], None]) -> None:
        """From now on (the replica serves; its own start-up no longer competes for CPU) ask the controller
        for the latency model's calibration and hand it to `on_calibration` once published."""
        self._on_calibration = on_calibration

    def wake(self) -> None:
        self._wake.set()

    def handle(self, worker_id: str) -> Any:
        return self.handles.get(worker_id)

    def mark_unhealthy(self, worker_id: str) -> None:
        if worker_id in self.stats:
            self.stats[worker_id] = self.stats[worker_id]._replace(healthy=False)

    # ---- background refresh ----------------------------------------------------------------------
    async def refresh_members(self) -> None:
        version, members = await asyncio.wait_for(self.controller.members.remote(), timeout=MEMBERS_TIMEOUT_S)
        if version == self.version:
            return
        self.handles = {wid: h for wid, _, h, _ in members}
        self.roles = {wid: role for wid, role, _, _ in members}
        self.stats = {w: s for w, s in self.stats.items() if w in self.handles}
        self.version = version
        for role in ("prefill", "decode", "colocated"):
            self._on_pool_sizes(role, sum(r == role for r in self.roles.values()))

    async def refresh_calibration(self) -> None:
        """Ask the controller to calibrate (idempotent) until its final result; hand on each new version."""
        if self._on_calibration is None or self.calibration_final or not self.ready():
            return
        if not self._calibration_asked:
            # NOTE: a measurement starts only while nothing is in flight (the deploy's own first answer
            # included): one that starts under a request only gives way to it and is tried again later.
            if self._busy() or any(s.waiting or s.running for s in self.stats.values()):
                return
            self._calibration_asked = True
        await asyncio.wait_for(self.controller.calibrate.remote(), timeout=MEMBERS_TIMEOUT_S)
        version, cal, final = await asyncio.wait_for(self.controller.calibration.remote(),
                                                     timeout=MEMBERS_TIMEOUT_S)
        self.calibration_final = final
        if version == self._calibration_version or cal is None:
            return
        self._calibration_version = version
        if isinstance(cal, str):
            logger.warning("%s; the router keeps its latency model", cal)
            self.calibration = self.calibration or cal
        else:
            self.calibration = cal
            self._on_calibration(cal)

    async def _members_loop(self) -> None:
        while True:
            try:
                await self.refresh_members()
                await self.refresh_calibration()
            except Exception as e:  # noqa: BLE001 - keep refreshing; the controller may restart
                logger.warning("membership refresh failed: %s", e)
            await asyncio.sleep(1.0 if self.ready() else 0.2)  # NOTE: faster until both pools answer

    async def refresh_stats(self) -> None:
        ids = list(self.handles)
        refs = [workers.stats(self.handles[w]) for w in ids]
        timeout = max(1.0, 10 * self.interval_s)
        results = await asyncio.gather(*(asyncio.wait_for(r, timeout=timeout) for r in refs),
                                       return_exceptions=True)
        for wid, res in zip(ids, results, strict=True):
            if wid not in self.handles:  # NOTE: left the pools while we waited: its answer would bring it back
                continue
            if isinstance(res, WorkerStats):
                self.stats[wid] = res
                self._on_stats(res)
            else:
                self.mark_unhealthy(wid)

    async def _stats_loop(self) -> None:
        while True:
            await self.refresh_stats()
            busy = self._busy() or any(s.waiting or s.running for s in self.stats.values())
            if busy or not self.ready():
                await asyncio.sleep(self.interval_s)
                continue
            # NOTE: idle: refresh slowly (idle engines then cost almost no CPU); a request wakes us at once.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(self.interval_s, IDLE_STATS_INTERVAL_S))

    # ---- what routing reads ----------------------------------------------------------------------
    def ready(self) -> bool:
        roles = {self.roles[w] for w in self.stats if self.stats[w].healthy and w in self.roles}
        if self.mode == "colocated":
            return "colocated" in roles
        return {"prefill", "decode"} <= roles

    def pools(self, exclude: set[str] | frozenset[str] = frozenset()) -> Pools:
        """Healthy workers per pool. A worker that failed this request is skipped while another healthy
        worker of its role exists; otherwise (a pool of one) we wait for Ray to restart it."""
        ok = [s for w, s in self.stats.items() if s.healthy and w in self.handles]

        def pool(role: str) -> list[WorkerStats]:
            members = [s for s in ok if self.roles.get(s.worker_id) == role]
            return [s for s in members if s.worker_id not in exclude] or members

        if self.mode == "colocated":
            return Pools([], pool("colocated"))
        return Pools(pool("prefill"), pool("decode"))

    def summary(self) -> list[dict[str, Any]]:
        return [dict(s._asdict(), recent_step_times_s=list(s.recent_step_times_s[-4:]))
                for w, s in self.stats.items() if w in self.handles]
