"""The Ray Serve ingress deployment: one replica = vLLM's OpenAI serving layer over our engine client,
the router's view of the pools, and (with serve.direct) its own HTTP server on serve.host:port.

Request path: HTTP -> Guard -> vLLM's route and serving class (renders the prompt) -> our admission
wrapper (a stream is routed before it starts) -> PDEngineClient.generate() -> legs: prefill -> KV ->
decode (or colocated) -> RequestOutputs -> vLLM's serving class -> JSON / SSE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray import serve

from cluster.config import DeployConfig
from cluster.router.admission import Admission
from cluster.router.policy import make_policy
from cluster.serve.direct import bind, serve_forever
from cluster.serve.frontend import build_frontend
from cluster.serve.leg import Services
from cluster.serve.membership import Membership
from cluster.serve.metrics import Metrics
from cluster.serve.traffic import REPORT_EVERY_S, TrafficLog, report_loop
from cluster.serve.transfers import TransferLog
from engine.models import resolve_model, served_name

logger = logging.getLogger(__name__)


def make_services(cfg: DeployConfig, controller: Any, metrics: Metrics, busy: Any) -> Services:
    pools = None if cfg.pools == "auto" else cfg.pools
    spec = cfg.pool_engines.apply("decode" if cfg.mode != "colocated" else "colocated", cfg.engine).speculative
    policy = make_policy(cfg.router.policy, router_cfg=cfg.router, slo=cfg.slo,
                         prefill_tp=pools and pools.prefill_tp, decode_tp=pools and pools.decode_tp,
                         max_prefill_tokens=cfg.pool_engines.apply(
                             "prefill" if cfg.mode != "colocated" else "colocated", cfg.engine).max_num_batched_tokens,
                         speculative_tokens=spec.num_speculative_tokens if spec is not None else 0)

    def on_stats(s: Any) -> None:
        for k in ("waiting", "running", "kv_usage"):
            metrics.worker.labels(s.worker_id, k).set(getattr(s, k))

    members = Membership(controller, cfg.mode, cfg.router.stats_interval_s, busy,
                         on_pool_sizes=lambda role, n: metrics.pool.labels(role).set(n), on_stats=on_stats)
    admission = Admission(policy, members, cfg.router, colocated=cfg.mode == "colocated",
                          recovery_timeout_s=cfg.serve.recovery_timeout_s, on_wait=metrics.queue.observe)
    traffic = TrafficLog() if cfg.planner_loop.mode != "off" else None
    return Services(cfg, members, admission, metrics, TransferLog(metrics), traffic)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    async def __init__(self, deploy_cfg: dict[str, Any], controller_name: str) -> None:
        t0 = time.monotonic()
        # NOTE: vLLM's serving layer is imported here, in the replica, not when the deploy CLI (the driver)
        # imports this module to name the deployment: the driver never needs vLLM.
        from cluster.serve.engine_client import PDEngineClient
        from cluster.serve.http import build_app

        logging.basicConfig(level=logging.INFO)
        self.cfg = cfg = DeployConfig.model_validate(deploy_cfg)
        model_dir = resolve_model(cfg.engine.model)
        name = cfg.engine.served_model_name or served_name(cfg.engine.model)
        self.metrics = Metrics()
        controller = ray.get_actor(controller_name, namespace=cfg.ray.namespace)
        self.svc = make_services(cfg, controller, self.metrics, busy=lambda: bool(getattr(self, "client", None) and self.client.jobs))
        t_frontend = time.monotonic()
        frontend = build_frontend(cfg, model_dir, name)
        self.client = PDEngineClient(frontend, self.svc)
        self.svc.members.start()
        self.planner: dict[str, Any] | None = None  # the planner loop's latest status, from the controller
        if self.svc.traffic is not None:
            replica = serve.get_replica_context().replica_id.unique_id
            every = min(REPORT_EVERY_S, cfg.planner_loop.interval_s / 2)
            self._reporter = asyncio.get_running_loop().create_task(
                report_loop(self.svc.traffic, controller, replica, every, self._on_planner))
        t_app = time.monotonic()
        self.http_app = await build_app(self.client, frontend.args, health=self._health, metrics=self.metrics.render,
                                   stats=self._stats)
        if cfg.router.calibrates() and hasattr(self.svc.admission.policy, "calibrate"):
            self.svc.members.enable_calibration(lambda cal: self.svc.admission.policy.calibrate(cal.coefficients))
        logger.info("ingress ready in %.1fs (imports %.1fs, vLLM frontend %.1fs, app %.1fs)", time.monotonic() - t0,
                    t_frontend - t0, t_app - t_frontend, time.monotonic() - t_app)
        self._server: asyncio.Task | None = None
        if cfg.serve.direct:
            sock = bind(cfg.serve.host, cfg.serve.port)
            self._server = asyncio.get_running_loop().create_task(
                serve_forever(self.http_app, sock, cfg.serve.route_prefix, cfg.serve.header_timeout_s,
                              cfg.serve.send_timeout_s, cfg.serve.max_connections))

    async def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    def _health(self) -> tuple[int, dict]:
        ready = self.svc.members.ready() and not self.client.draining
        status = "draining" if self.client.draining else "ok" if ready else "starting"
        return (200 if ready else 503), {"status": status, "workers": self.svc.members.summary()}

    def _on_planner(self, status: dict[str, Any] | None) -> None:
        self.planner = status
        if status is not None:
            self.metrics.planner(status)

    def _stats(self) -> dict:
        cal = self.svc.members.calibration
        return {"planner": self.planner,"workers": self.svc.members.summary(), "transfers": self.svc.transfers.records(),
                "queued": self.svc.admission.queued, "inflight": self.client.inflight,
                "router": self.svc.admission.policy.describe(),
                "calibration": None if cal is None else {"error": cal} if isinstance(cal, str) else {
                    "source": cal.source, "key": cal.key, "at": cal.at, "prefill_r2": cal.prefill_r2,
                    "decode_r2": cal.decode_r2, "coefficients": cal.coefficients.model_dump(),
                    "final": self.svc.members.calibration_final}}

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose own HTTP server died is replaced."""
        if self._server is not None and self._server.done():
            raise RuntimeError(f"the direct HTTP server on {self.cfg.serve.host}:{self.cfg.serve.port} stopped: "
                               f"{self._server.exception() if not self._server.cancelled() else 'cancelled'}")

    # ---- graceful shutdown (called through the app's Serve handle by cluster.control.lifecycle) --------
    async def begin_drain(self) -> int:
        """Stop admitting: new requests get 503 and /health says draining. Returns requests in flight."""
        self.client.draining = True
        return self.client.inflight

    async def inflight_requests(self) -> int:
        return self.client.inflight

    async def abort_inflight(self) -> int:
        """The grace period is over: every request still running ends at its next token with an error."""
        self.client.aborting = True
        return self.client.inflight
