"""Live routing state inside an ingress replica: pool membership, worker stats refreshed in the
background, the router policy, admission, and the request runners that call the workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from cluster.config import DeployConfig
from cluster.metrics import Metrics
from cluster.openai_api import APIError
from cluster.router import RouteDecision, RouteRequest, make_policy
from engine.stats import WorkerStats

logger = logging.getLogger(__name__)
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


IDLE_STATS_INTERVAL_S = 1.0  # worker stats refresh period while nothing is in flight

class _WorkerDied(Exception):
    def __init__(self, worker: str, cause: BaseException) -> None:
        super().__init__(worker)
        self.worker, self.cause = worker, cause


class RoutingState:
    def __init__(self, cfg: DeployConfig, controller: Any, metrics: Metrics) -> None:
        self.cfg = cfg
        self.controller = controller
        self.metrics = metrics
        pools = None if cfg.pools == "auto" else cfg.pools
        self.policy = make_policy(cfg.router.policy, router_cfg=cfg.router, slo=cfg.slo,
                                  prefill_tp=pools and pools.prefill_tp, decode_tp=pools and pools.decode_tp,
                                  max_prefill_tokens=cfg.engine.max_num_batched_tokens)
        self.handles: dict[str, Any] = {}
        self.roles: dict[str, str] = {}
        self.stats: dict[str, WorkerStats] = {}
        self.version = -1
        self.queued = 0
        self.active = 0  # requests of this ingress between arrival and their last token
        self._wake = asyncio.Event()
        self._transfers: deque[dict] = deque(maxlen=256)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_event_loop()
        self._tasks = [loop.create_task(self._members_loop()), loop.create_task(self._stats_loop())]

    # ---- background refresh ----------------------------------------------------------------------
    async def _members_loop(self) -> None:
        while True:
            try:
                version, members = await asyncio.wait_for(self.controller.members.remote(), timeout=10)
                if version != self.version:
                    self.handles = {wid: h for wid, _, h, _ in members}
                    self.roles = {wid: role for wid, role, _, _ in members}
                    self.stats = {w: s for w, s in self.stats.items() if w in self.handles}
                    self.version = version
                    for role in ("prefill", "decode", "colocated"):
                        self.metrics.pool.labels(role).set(sum(r == role for r in self.roles.values()))
            except Exception as e:  # noqa: BLE001 - keep refreshing; the controller may restart
                logger.warning("membership refresh failed: %s", e)
            await asyncio.sleep(1.0 if self.ready() else 0.2)  # NOTE: faster until both pools answer

    async def _stats_loop(self) -> None:
        period = self.cfg.router.stats_interval_s
        while True:
            ids = list(self.handles)
            refs = [self.handles[w].stats.remote() for w in ids]
            results = await asyncio.gather(*(asyncio.wait_for(r, timeout=max(1.0, 10 * period)) for r in refs),
                                           return_exceptions=True)
            for wid, res in zip(ids, results, strict=True):
                if isinstance(res, WorkerStats):
                    self.stats[wid] = res
                    for k in ("waiting", "running", "kv_usage"):
                        self.metrics.worker.labels(wid, k).set(getattr(res, k))
                elif wid in self.stats:
                    self.stats[wid] = self.stats[wid]._replace(healthy=False)
            busy = self.active or any(s.waiting or s.running for s in self.stats.values())
            if busy or not self.ready():
                await asyncio.sleep(period)
                continue
            # NOTE: idle: refresh slowly (idle engines then cost almost no CPU); a request wakes us at once.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(period, IDLE_STATS_INTERVAL_S))

    def ready(self) -> bool:
        roles = [self.roles[w] for w in self.stats if self.stats[w].healthy]
        if self.cfg.mode == "colocated":
            return "colocated" in roles
        return "prefill" in roles and "decode" in roles

    def summary(self) -> list[dict[str, Any]]:
        return [dict(s._asdict(), recent_step_times_s=list(s.recent_step_times_s[-4:]))
                for s in self.stats.values()]

    def transfer_log(self) -> list[dict]:
        return list(self._transfers)

    # ---- routing and admission -------------------------------------------------------------------
    def _pools(self, exclude: set[str]) -> tuple[list[WorkerStats], list[WorkerStats]]:
        """Healthy workers per pool. A worker that failed this request is skipped while another
        healthy worker of its role exists; otherwise (a pool of one) we wait for Ray to restart it."""
        ok = [s for w, s in self.stats.items() if s.healthy and w in self.handles]

        def pool(role: str) -> list[WorkerStats]:
            members = [s for s in ok if self.roles.get(s.worker_id) == role]
            return [s for s in members if s.worker_id not in exclude] or members

        if self.cfg.mode == "colocated":
            return [], pool("colocated")
        return pool("prefill"), pool("decode")

    async def route(self, req: RouteRequest, exclude: set[str] = frozenset(),
                    must_admit: bool = False) -> RouteDecision:
        """Pick workers, applying admission. ``must_admit`` (retries of a request already admitted)
        skips admission but still waits for a healthy worker, up to serve.recovery_timeout_s."""
        t0 = time.monotonic()
        rc = self.cfg.router
        queued = False
        try:
            while True:
                prefill, decode = self._pools(set(exclude))
                waited = time.monotonic() - t0
                if not decode or not (prefill or self.cfg.mode == "colocated"):
                    if waited > self.cfg.serve.recovery_timeout_s:
                        raise APIError(503, "no healthy workers in the pools; retry later",
                                       type_="service_unavailable", headers={"Retry-After": "5"})
                    await asyncio.sleep(0.1)
                    continue
                if queued and rc.admission == "queue" and req.ttft_slo_s - waited <= 0:
                    raise APIError(429, f"TTFT target of {req.ttft_slo_s * 1000:.0f} ms passed while queued; "
                                   "retry later", type_="rate_limit_exceeded", code="slo_unattainable",
                                   headers={"Retry-After": "1"})
                d = self.policy(req._replace(ttft_slo_s=req.ttft_slo_s - waited), prefill, decode)
                if d.admit or must_admit or rc.admission == "best_effort":
                    return d._replace(admit=True)
                if rc.admission == "reject":
                    raise APIError(429, f"no worker can meet the SLO now ({d.reason}); retry later",
                                   type_="rate_limit_exceeded", code="slo_unattainable",
                                   headers={"Retry-After": "1"})
                if not queued:
                    if self.queued >= rc.max_queue:
                        raise APIError(429, f"admission queue full ({rc.max_queue} waiting); retry later",
                                       type_="rate_limit_exceeded", headers={"Retry-After": "1"})
                    self.queued += 1
                    queued = True
                if waited > rc.queue_timeout_s:
                    raise APIError(429, f"not admitted within {rc.queue_timeout_s:.0f}s; retry later",
                                   type_="rate_limit_exceeded", headers={"Retry-After": "1"})
                await asyncio.sleep(0.05)
        finally:
            if queued:
                self.queued -= 1
            self.metrics.queue.observe(time.monotonic() - t0)

    # ---- running a request -----------------------------------------------------------------------
    async def first_or_error(self, run: AsyncIterator[dict]) -> dict | None:
        try:
            return await anext(run)
        except StopAsyncIteration:
            return None

    async def run(self, rid: str, ids: list[int], params: dict, route: RouteRequest) -> AsyncIterator[dict]:
        """Yield deltas for one request; record metrics. Raises APIError for client-visible failures."""
        t0 = time.monotonic()
        sc = self.cfg.serve
        n_out, last, first_at, ok = 0, None, None, False
        self.active += 1
        self._wake.set()
        decision: RouteDecision | None = None
        routed_at = t0
        try:
            async for d in self._run(rid, ids, params, route):
                if "route" in d:
                    decision = d.pop("route")
                    routed_at = time.monotonic()
                    continue
                now = time.monotonic()
                if d["token_ids"]:
                    if first_at is None:
                        first_at = now
                        self.metrics.ttft.observe(now - t0)
                    elif last is not None:
                        self.metrics.itl.observe(now - last)
                    last = now
                    n_out += len(d["token_ids"])
                if now - t0 > sc.request_timeout_s:
                    raise APIError(504, f"request exceeded {sc.request_timeout_s:.0f}s", type_="timeout")
                yield d
            ok = True
        except APIError as e:
            self.metrics.requests.labels("rejected" if e.status == 429 else "error").inc()
            raise
        finally:
            self.active -= 1
            e2e = time.monotonic() - t0
            self.metrics.tokens.labels("input").inc(len(ids))
            self.metrics.tokens.labels("output").inc(n_out)
            if ok:
                self.metrics.requests.labels("ok").inc()
                self.metrics.e2e.observe(e2e)
                ttft = (first_at or time.monotonic()) - t0
                tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else 0.0
                self.metrics.slo(ttft <= route.ttft_slo_s and tpot <= route.tpot_slo_s)
                observe = getattr(self.policy, "observe", None)
                if observe is not None and decision is not None:
                    # NOTE: feedback for policies that correct their predictions online (EWMA).
                    observe(decision, route, (first_at or time.monotonic()) - routed_at,
                            tpot if n_out > 1 else None)

    async def _stream(self, gen: Any, timeout: float) -> AsyncIterator[dict]:
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(gen.__anext__(), timeout=timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise APIError(504, f"no token for {timeout:.0f}s; request aborted", type_="timeout") from None
                yield await ref
        finally:
            try:
                ray.cancel(gen)
            except Exception:  # noqa: BLE001 - already finished
                pass

    async def _run(self, rid: str, ids: list[int], params: dict, route: RouteRequest) -> AsyncIterator[dict]:
        """Route and run; if a worker dies, retry elsewhere (or on the same worker once Ray has restarted
        it). A decode worker lost mid-stream is migrated: prompt + the tokens already streamed are
        prefilled again and decoding continues on a decode worker, so the client's stream goes on."""
        produced: list[int] = []
        excluded: set[str] = set()
        for attempt in range(4):
            left = params["max_tokens"] - len(produced)
            if left < 1:
                return
            prompt = ids + produced
            p = dict(params, max_tokens=left, min_tokens=max(0, params.get("min_tokens", 0) - len(produced)))
            r = route._replace(prompt_tokens=len(prompt), max_tokens=left)
            dec = await self.route(r, excluded, must_admit=attempt > 0)
            yield {"route": dec, "token_ids": []}
            try:
                async for d in self._attempt(rid if attempt == 0 else f"{rid}-r{attempt}", prompt, p, dec):
                    produced.extend(d["token_ids"])
                    yield d
                return
            except _WorkerDied as e:
                logger.warning("worker %s died serving %s after %d tokens (attempt %d): %s", e.worker, rid,
                               len(produced), attempt + 1, e.cause)
                self.metrics.requests.labels("migrated" if produced else "retried").inc()
                excluded.add(e.worker)
                if e.worker in self.stats:
                    self.stats[e.worker] = self.stats[e.worker]._replace(healthy=False)
        raise APIError(503, "request failed on 4 workers in a row; retry later", type_="service_unavailable")

    async def _attempt(self, rid: str, ids: list[int], params: dict, dec: RouteDecision) -> AsyncIterator[dict]:
        sc = self.cfg.serve
        if self.cfg.mode == "colocated" or params["max_tokens"] == 1:
            wid = dec.decode if self.cfg.mode == "colocated" else dec.prefill
            gen = self.handles[wid].generate_stream.options(num_returns="streaming").remote(rid, ids, params)
            try:
                async for d in self._stream(gen, sc.token_timeout_s):
                    yield d
            except _DEAD as e:
                raise _WorkerDied(wid, e) from None
            return
        try:
            pre = await asyncio.wait_for(
                self.handles[dec.prefill].prefill.remote(rid, ids, params), timeout=sc.request_timeout_s)
        except _DEAD as e:
            raise _WorkerDied(dec.prefill, e) from None
        except TimeoutError:
            raise APIError(504, f"prefill exceeded {sc.request_timeout_s:.0f}s", type_="timeout") from None
        except ray.exceptions.RayTaskError as e:
            raise APIError(502, f"engine failed: {getattr(e, 'cause', e)}", type_="engine_error") from None
        self.metrics.prefill.observe(pre["handoff"]["prefill_s"])
        gen = self.handles[dec.decode].decode_stream.options(num_returns="streaming").remote(
            rid, ids, params, pre["handoff"])
        try:
            async for d in self._stream(gen, self.cfg.transfer.transfer_timeout_s + sc.token_timeout_s):
                tel = d.pop("telemetry", None)
                if tel is not None:
                    self._record_transfer(tel)
                yield d
        except _DEAD as e:
            raise _WorkerDied(dec.decode, e) from None
        except ray.exceptions.RayTaskError as e:
            raise APIError(502, f"decode failed: {getattr(e, 'cause', e)}", type_="kv_transfer_error") from None

    def _record_transfer(self, tel: dict) -> None:
        self._transfers.append(tel)
        self.metrics.transfer.observe(tel["transfer_wait_s"])
        if tel["outcome"] == "ok":
            self.metrics.kv_bytes.inc(tel["kv_bytes"])
        elif tel["outcome"] == "recomputed":
            self.metrics.recomputes.inc()
            self.metrics.kv_failures.inc()
        else:
            self.metrics.kv_failures.inc()
