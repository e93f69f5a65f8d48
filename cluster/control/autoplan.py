"""The planner loop: every `planner_loop.interval_s` the PoolController re-plans both pools from the
traffic its ingress replicas saw (cluster/serve/traffic.py) and the latency they measured.

The planning itself is placement.replan.Replanner (pure): forecast, online correction of the latency
model, sizing by simulation, hysteresis and cooldown. This module feeds it and acts on it:
- `advisory` (the default): logs each decision and hands it to the ingress replicas (/v1/stats
  `planner`, saaf_planner_* metrics); the pools stay as they are.
- `on`: also asks Ray's autoscaler for the whole planned set of worker bundles each interval
  (`ray.autoscaler.sdk.request_resources` keeps only the latest request, so a smaller set after a
  shrink is the clear), and resizes the pools with PoolController.scale: new workers join routing when
  ready; a removed worker first leaves routing, then drains (in-flight requests finish, handoffs pinned
  on a prefill worker are pulled, released or expire), then stops. A shrink drains first the workers the
  decision found slower than their pool (`Decision.drain_order`), then the newest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from placement.replan import Decision, LoopSettings, Replanner, Sizes, TrafficWindow, merge_windows

logger = logging.getLogger(__name__)
LIVE = ("ready", "starting", "replacing")  # states of a pool's members (draining ones are leaving)
# NOTE: sizing is pure Python in a thread of the controller and holds the GIL while it simulates; smaller
# probes keep membership and health calls prompt
LIVE_PROBE_REQUESTS = 800


def resource_bundles(shape: Any, count: int) -> list[dict[str, float]]:
    """What `count` engines of `shape` ask of the autoscaler: a STRICT_PACK engine as one bundle (all of it
    must fit on one node), a PACK engine (spans nodes) bundle by bundle."""
    per = [shape.capacity] if shape.strategy == "STRICT_PACK" else list(shape.bundles)
    return [dict(b) for _ in range(count) for b in per]


def request_pool_resources(bundles: list[dict[str, float]]) -> bool:
    """Ask Ray's autoscaler for the whole desired set (it keeps only the latest request: [] clears it), so a
    `ray up` cluster grows nodes for engines that do not fit and may remove idle ones once they are not
    asked for. False (logged) where no autoscaler can be asked; scaling still works within the cluster."""
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=bundles)
        return True
    except Exception as e:  # noqa: BLE001 - no autoscaler to ask (a fixed cluster): scaling still works
        logger.warning("planner loop: request_resources failed (%s); resizing within the cluster", e)
        return False


class Pools(Protocol):
    """What the loop reads from and does to the pools (cluster/control/pools.py's PoolController, which owns
    the loop: the loop names the controller only by this, so the arrow points one way)."""

    cfg: Any
    workers: dict[str, dict[str, Any]]
    calibrated: tuple[int, Any]  # (version, latest Calibration of this machine, or None)

    def engine_for(self, role: str) -> Any: ...

    def reported(self, role: str, key: str, fallback: Any = None) -> Any: ...

    def shape_for(self, role: str, gpus_per_node: int | None = None) -> Any: ...

    async def scale(self, role: str, target: int, drain_timeout_s: float = 120,
                    first: Sequence[str] = ()) -> dict[str, Any]: ...


class PlannerLoop:
    def __init__(self, ctl: Pools) -> None:
        self.ctl = ctl
        self.cfg = ctl.cfg.planner_loop
        self.colocated = ctl.cfg.mode == "colocated"
        self._windows: list[TrafficWindow] = []
        self._since = time.time()
        self._replanner: Replanner | None = None
        self._cal_version = -1
        self.last: Decision | None = None
        self.error: str | None = None
        self.actions: list[dict[str, Any]] = []
        self._scaling: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self.requested: list[dict[str, float]] | None = None
        self.acceptance: float | None = None  # a speculating decode pool's measured acceptance rate
        self._base_decode: Any = None

    # ---- what the ingress replicas call (through the controller) ----------------------------------
    def report(self, windows: list[TrafficWindow]) -> dict[str, Any]:
        self._windows.extend(windows)
        del self._windows[:-1000]  # NOTE: bounded, whatever the number of replicas
        return self.status()

    def status(self) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "interval_s": self.cfg.interval_s,
                "decision": None if self.last is None else self.last.as_dict(), "error": self.error,
                "scaling": self._scaling is not None and not self._scaling.done(),
                "actions": self.actions[-20:], "requested_resources": self.requested,
                "speculative_acceptance": self.acceptance}

    # ---- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._since = time.time()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for t in (self._task, self._scaling):
            if t is not None:
                t.cancel()
        if self.requested:
            self._request([])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
                self.error = None
            except Exception as e:  # noqa: BLE001 - the loop goes on; the status shows why it did nothing
                self.error = f"{type(e).__name__}: {e}"
                logger.exception("planner loop: re-plan failed")

    def sizes(self) -> Sizes:
        live = [w["role"] for w in self.ctl.workers.values() if w["state"] in LIVE]
        if self.colocated:
            return Sizes(0, live.count("colocated"))
        return Sizes(live.count("prefill"), live.count("decode"))

    async def tick(self) -> Decision:
        now = time.time()
        window = merge_windows(self._windows, self._since, now)
        self._windows, self._since = [], now
        current = self.sizes()
        rp = self.replanner()
        self._speculation(rp)
        # NOTE: sizing runs a few hundred simulated requests per probe: in a thread, so the controller keeps
        # answering membership and health calls meanwhile.
        d = await asyncio.to_thread(rp.step, window, current)
        self.last = d
        logger.info("planner loop (%s): %.3g req/s seen, %.3g forecast; wants %s, sets %s (now %s); predicted "
                    "attainment %.2f; %s", self.cfg.mode, d.observed_rps, d.forecast_rps, tuple(d.wanted),
                    tuple(d.target), tuple(current), d.predicted_attainment, d.reason)
        if self.cfg.mode != "on":
            return d
        if self.cfg.request_resources:
            self._request(self.bundles(d.target))
        if d.target != current and (self._scaling is None or self._scaling.done()):
            self._scaling = asyncio.get_running_loop().create_task(self._apply(current, d.target, d))
        return d

    def replanner(self) -> Replanner:
        """Built on the router's latency model; rebuilt on it when the controller publishes a calibration."""
        from cluster.router.latency import latency_from_config

        version, cal = self.ctl.calibrated
        if self._replanner is not None and version == self._cal_version:
            return self._replanner
        p_lat = latency_from_config(self.ctl.cfg.router, self.ctl.engine_for("prefill").tensor_parallel_size)
        d_lat = latency_from_config(self.ctl.cfg.router, self.ctl.engine_for("decode").tensor_parallel_size)
        if cal is not None:
            p_lat = p_lat.refitted(cal.coefficients, "calibrated")
            d_lat = d_lat.refitted(cal.coefficients, "calibrated")
        c = self.cfg
        role = "colocated" if self.colocated else "prefill"
        engine = self.ctl.engine_for(role)
        lo = Sizes(0 if self.colocated else c.min_prefill, c.min_decode)
        settings = LoopSettings(min=lo, max=Sizes(0 if self.colocated else c.max_prefill, c.max_decode),
                                down_after=c.down_after, cooldown_s=c.cooldown_s, up_cooldown_s=c.up_cooldown_s,
                                max_prefill_tokens=self.ctl.reported(role, "max_num_batched_tokens",
                                                                     engine.max_num_batched_tokens)
                                or LoopSettings.max_prefill_tokens,
                                # NOTE: None in the config is vLLM's default: on
                                chunked_prefill=self.ctl.reported(role, "chunked_prefill",
                                                                  engine.enable_chunked_prefill) is not False,
                                colocated=self.colocated, max_probe_requests=LIVE_PROBE_REQUESTS)
        old = self._replanner
        self._base_decode, self.acceptance = d_lat, None
        self._replanner = Replanner(p_lat, d_lat, self.ctl.cfg.slo.spec(), settings)
        if old is not None:  # NOTE: the traffic history stays; corrections learnt against the old model do not
            self._replanner.forecaster = old.forecaster
            self._replanner._recent = old._recent
            self._replanner._changed_at = old._changed_at
        self._cal_version = version
        return self._replanner

    def _speculation(self, rp: Replanner) -> None:
        """A speculating decode pool: its model's decode step divided by the tokens a step yields at the
        acceptance rate its engines report (LatencyModel.with_speculation), as the router predicts it. Read
        from the stats the health checks last fetched; until an engine reports one, the plain model (the
        online TPOT correction covers the difference meanwhile)."""
        role = "colocated" if self.colocated else "decode"
        spec = self.ctl.engine_for(role).speculative
        if spec is None:
            return
        rates = [w["stats"].spec_acceptance for w in self.ctl.workers.values()
                 if w["role"] == role and w["state"] == "ready" and w.get("stats") is not None
                 and w["stats"].spec_acceptance is not None]
        if not rates:
            return
        a = round(sum(rates) / len(rates), 2)
        if a == self.acceptance:
            return
        self.acceptance = a
        rp.set_decode_model(self._base_decode.with_speculation(spec.num_speculative_tokens, a))
        logger.info("planner loop: the %s pool speculates %d tokens at a measured acceptance of %.2f", role,
                    spec.num_speculative_tokens, a)

    def bundles(self, target: Sizes) -> list[dict[str, float]]:
        roles = {"colocated": target.decode} if self.colocated else {"prefill": target.prefill,
                                                                      "decode": target.decode}
        return [b for role, n in roles.items() for b in resource_bundles(self.ctl.shape_for(role), n)]

    def _request(self, bundles: list[dict[str, float]]) -> None:
        if request_pool_resources(bundles):
            self.requested = bundles

    async def _apply(self, current: Sizes, target: Sizes, d: Decision) -> None:
        roles = ([("colocated", current.decode, target.decode)] if self.colocated else
                 [("prefill", current.prefill, target.prefill), ("decode", current.decode, target.decode)])
        moves = [(r, a, b) for r, a, b in roles if a != b]

        async def one(role: str, frm: int, to: int) -> None:
            t0 = time.time()
            act: dict[str, Any] = {"at": t0, "role": role, "from": frm, "to": to}
            try:
                res = await self.ctl.scale(role, to, drain_timeout_s=self.cfg.drain_timeout_s,
                                           first=d.drain_order(role))
                act.update(res, outcome="done")
            except Exception as e:  # noqa: BLE001 - reported in the status; the next interval tries again
                act.update(outcome="failed", error=str(e)[:300])
                logger.error("planner loop: scaling %s %d -> %d failed: %s", role, frm, to, e)
            act["seconds"] = round(time.time() - t0, 2)
            self.actions.append(act)
            del self.actions[:-100]

        await asyncio.gather(*(one(*m) for m in moves))
