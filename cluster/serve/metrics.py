"""Prometheus metrics of the ingress, served at GET /metrics on the endpoint itself."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("saaf_ttft_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("saaf_itl_seconds", "Inter-token latency", buckets=_LAT, registry=r)
        self.e2e = Histogram("saaf_e2e_seconds", "End-to-end request latency", buckets=_LAT, registry=r)
        self.prefill = Histogram("saaf_prefill_seconds", "Prefill time on the prefill worker",
                                 buckets=_LAT, registry=r)
        self.transfer = Histogram("saaf_kv_transfer_seconds", "Decode submit to first decode output "
                                  "(KV pull + one step)", buckets=_LAT, registry=r)
        self.queue = Histogram("saaf_queue_wait_seconds", "Admission queue wait", buckets=_LAT, registry=r)
        self.requests = Counter("saaf_requests", "Requests by outcome", ["outcome"], registry=r)
        self.tokens = Counter("saaf_tokens", "Tokens", ["kind"], registry=r)
        self.kv_bytes = Counter("saaf_kv_bytes", "KV bytes handed from prefill to decode", registry=r)
        self.kv_failures = Counter("saaf_kv_transfer_failures", "KV transfers that failed", registry=r)
        self.recomputes = Counter("saaf_kv_recomputes", "Requests whose decode recomputed the prompt",
                                  registry=r)
        self.kv_mismatches = Counter("saaf_kv_integrity_mismatches", "KV pulls whose blocks differed from the "
                                     "prefill engine's digest (transfer.integrity)", registry=r)
        self.placement = Counter("saaf_prefill_placement", "Where admitted prompts were prefilled "
                                 "(router.disaggregation): remote = a prefill worker, local = the decode worker",
                                 ["where", "why"], registry=r)
        self.worker = Gauge("saaf_worker", "Per-worker stats", ["worker", "stat"], registry=r)
        self.pool = Gauge("saaf_pool_size", "Workers per pool", ["role"], registry=r)
        self.goodput = Gauge("saaf_goodput_rps", "Requests meeting both SLOs per second, last minute",
                             registry=r)
        self.plan_size = Gauge("saaf_planner_target", "Pool size the planner loop sets (advisory: would set)",
                               ["role"], registry=r)
        self.plan_want = Gauge("saaf_planner_wanted", "Pool size the planner loop's forecast needs", ["role"],
                               registry=r)
        self.plan_rate = Gauge("saaf_planner_rate_rps", "Arrival rate the planner loop saw / forecast",
                               ["kind"], registry=r)
        self.plan_goodput = Gauge("saaf_planner_predicted_goodput_rps", "Goodput the planner loop predicts for "
                                  "its target pools at the planned rate", registry=r)
        self.plan_worker = Gauge("saaf_planner_worker_ratio", "A worker's median TTFT / TPOT over its pool's, as "
                                 "the planner loop sees it (1: like its pool)", ["worker", "role", "kind"],
                                 registry=r)
        self._met: deque[float] = deque()

    def planner(self, status: dict) -> None:
        d = status.get("decision")
        if not d:
            return
        for role in ("prefill", "decode"):
            self.plan_size.labels(role).set(d["target"][role])
            self.plan_want.labels(role).set(d["wanted"][role])
        self.plan_rate.labels("observed").set(d["observed_rps"])
        self.plan_rate.labels("forecast").set(d["forecast_rps"])
        self.plan_goodput.set(d["predicted_goodput_rps"])
        self.plan_worker.clear()  # NOTE: a worker that left the decision leaves the metric
        for w in d.get("workers") or ():
            for kind in ("ttft", "tpot"):
                if w[kind] is not None:
                    self.plan_worker.labels(w["worker"], w["role"], kind).set(w[kind])

    def slo(self, met: bool) -> None:
        self.requests.labels("slo_met" if met else "slo_missed").inc()
        now = time.monotonic()
        if met:
            self._met.append(now)
        while self._met and self._met[0] < now - 60:
            self._met.popleft()
        self.goodput.set(len(self._met) / 60.0)

    def render(self) -> bytes:
        now = time.monotonic()
        while self._met and self._met[0] < now - 60:
            self._met.popleft()
        self.goodput.set(len(self._met) / 60.0)
        return generate_latest(self.registry)
