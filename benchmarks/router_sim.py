"""Router policies in placement's simulator: the same bursty trace, the same pools, one row per policy.

`StatsDispatch` adapts a router policy (which sees WorkerStats, as in the ingress) to placement's
DispatchPolicy (which sees InstanceView). It reports what live workers report: a prefill worker's
`queued_prompt_tokens` includes its in-flight batch (live workers count a prompt until its first
token), which the adapter recovers by replaying the instance's FIFO batching (`_PrefillMirror`).
A refused decision (`admit=False`) rejects the request (counted as an SLO miss) unless
`best_effort`. The simulator has no admission queue: `queue` deployments behave like `reject` here.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from cluster.config import SLOConfig
from cluster.router.policy import RouteRequest, make_policy
from engine.contract import WorkerStats
from placement.config import LengthDist
from placement.dispatch import InstanceView
from placement.latency import LatencyModel
from placement.simulator import simulate_disaggregated
from placement.workload import Request, gamma_trace, sample_lengths

logger = logging.getLogger(__name__)

POLICY_NAMES = ("goodput", "least_loaded", "round_robin")
SHORT = LengthDist(kind="lognormal", mean=120, sd=80, min=8, max=600)
LONG = LengthDist(kind="lognormal", mean=800, sd=200, min=500, max=1200)
OUTPUT = LengthDist(kind="lognormal", mean=64, sd=48, min=2, max=256)


class Pools(NamedTuple):
    prefill: int
    decode: int


class PolicyResult(NamedTuple):
    policy: str
    admission: str  # "reject" (refusals become SLO misses) or "best_effort" (served anyway)
    requests: int
    rejected: int
    attainment: float  # of all requests; rejected ones count as misses
    admitted_attainment: float  # of the requests served
    goodput_rps: float  # requests meeting both targets per second of the trace's arrival span
    ttft_p90_s: float
    tpot_p90_s: float


def bursty_trace(n: int, rate_rps: float, cv: float = 3.0, seed: int = 0,
                 long_share: float = 0.25) -> list[Request]:
    """Gamma arrivals (coefficient of variation `cv`) with a mix of short chat prompts and long documents."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share={long_share} must be in [0, 1]")
    fixed = LengthDist(kind="fixed", value=1)
    arrivals = [r.arrival_s for r in gamma_trace(n, rate_rps, cv, fixed, fixed, seed=seed)]
    rng = np.random.default_rng(seed + 1)
    short, long_ = sample_lengths(SHORT, n, rng), sample_lengths(LONG, n, rng)
    inputs = np.where(rng.random(n) < long_share, long_, short)
    outputs = sample_lengths(OUTPUT, n, rng)
    return [Request(a, int(i), int(o)) for a, i, o in zip(arrivals, inputs, outputs, strict=True)]


class _PrefillMirror:
    """Replays one simulated prefill instance (FIFO, batches of up to `max_tokens`, pp=1)."""

    __slots__ = ("lat", "max_tokens", "queue", "busy_until", "batch_tokens", "batch_n")

    def __init__(self, lat: LatencyModel, max_tokens: int) -> None:
        self.lat, self.max_tokens = lat, max_tokens
        self.queue: deque[int] = deque()
        self.busy_until = 0.0
        self.batch_tokens = self.batch_n = 0

    def advance(self, now: float) -> None:
        while self.batch_n and self.busy_until <= now:
            self.batch_tokens = self.batch_n = 0
            if self.queue:
                self._start(self.busy_until)

    def add(self, now: float, prompt: int) -> None:
        self.queue.append(prompt)
        if not self.batch_n:
            self._start(now)

    def _start(self, t: float) -> None:
        total = sq = n = 0
        while self.queue and (n == 0 or total + self.queue[0] <= self.max_tokens):
            length = self.queue.popleft()
            total, sq, n = total + length, sq + length * length, n + 1
        self.batch_tokens, self.batch_n = total, n
        self.busy_until = t + self.lat.prefill_time_from_sums(total, sq)

    def queued_tokens(self) -> int:
        return sum(self.queue)


class StatsDispatch:
    """DispatchPolicy that asks the router policy `name`, fed with WorkerStats built from the views."""

    def __init__(self, name: str, latency: LatencyModel, slo: SLOConfig, n_prefill: int, *,
                 best_effort: bool = False, max_prefill_tokens: int = 4096) -> None:
        if latency.pp != 1:
            raise ValueError(f"StatsDispatch replays pp=1 prefill instances; the latency model has "
                             f"pp={latency.pp}")
        self.now = 0.0
        self.policy = make_policy(name, latency=latency, slo=slo, clock=lambda: self.now,
                                  max_prefill_tokens=max_prefill_tokens, record_refused=best_effort)
        self.ttft_s, self.tpot_s = slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0
        self.best_effort = best_effort
        self.mirrors = [_PrefillMirror(latency, max_prefill_tokens) for _ in range(n_prefill)]
        self.refused = 0
        self.mirror_mismatches = 0  # arrivals where the replay disagreed with the simulator (expect 0)

    def choose(self, now_s: float, prompt_len: int, output_len: int,
               prefill: Sequence[InstanceView], decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        self.now = now_s
        ps = []
        for v, m in zip(prefill, self.mirrors, strict=True):
            m.advance(now_s)
            if m.queued_tokens() != v.queued_prompt_tokens:
                self.mirror_mismatches += 1
            ps.append(WorkerStats(f"p{v.index}", "prefill", "", v.queued_requests, m.batch_n,
                                  v.queued_prompt_tokens + m.batch_tokens, 0, 0.0, 0, (), True, now_s))
        ds = [WorkerStats(f"d{v.index}", "decode", "", v.queued_requests, v.running, v.queued_prompt_tokens,
                          v.context_tokens, v.kv_used_tokens / v.kv_capacity_tokens if v.kv_capacity_tokens
                          else 0.0, v.kv_capacity_tokens, (), True, now_s) for v in decode]
        dec = self.policy(RouteRequest(prompt_len, output_len, self.ttft_s, self.tpot_s), ps, ds)
        if not dec.admit:
            self.refused += 1
            if not self.best_effort:
                return None
        assert dec.prefill is not None and dec.decode is not None
        p = int(dec.prefill[1:])
        self.mirrors[p].add(now_s, prompt_len)
        return p, int(dec.decode[1:])


def compare_policies(trace: Sequence[Request], pools: Pools, latency: LatencyModel, slo: SLOConfig, *,
                     policies: Sequence[str] = POLICY_NAMES, goodput_best_effort: bool = True,
                     max_prefill_tokens: int = 4096) -> list[PolicyResult]:
    """Simulate `trace` on `pools` once per policy (plus goodput with best-effort admission)."""
    if not trace:
        raise ValueError("compare_policies needs a non-empty trace")
    runs = [(name, False) for name in policies]
    if goodput_best_effort and "goodput" in policies:
        runs.append(("goodput", True))
    ttft_s, tpot_s = slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0
    arrivals = [r.arrival_s for r in trace]
    span = max(max(arrivals) - min(arrivals), 1e-9)
    rows = []
    for name, best_effort in runs:
        disp = StatsDispatch(name, latency, slo, pools.prefill, best_effort=best_effort,
                             max_prefill_tokens=max_prefill_tokens)
        res = simulate_disaggregated(latency, latency, pools.prefill, pools.decode, trace, dispatch=disp,
                                     max_prefill_tokens=max_prefill_tokens, first_token_from_prefill=True)
        if disp.mirror_mismatches:
            logger.warning("%s: prefill replay disagreed with the simulator at %d arrivals", name,
                           disp.mirror_mismatches)
        met = res.attainment(ttft_s, tpot_s) * res.total
        rows.append(PolicyResult(name, "best_effort" if best_effort else "reject", res.total, res.rejected,
                                 met / res.total, met / res.completed if res.completed else 0.0, met / span,
                                 res.ttft().p90, res.tpot().p90))
    return rows


def format_table(rows: Sequence[PolicyResult]) -> str:
    head = (f"{'policy':<23}{'attainment':>11}{'of served':>11}{'goodput':>14}{'rejected':>10}"
            f"{'TTFT p90':>10}{'TPOT p90':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = r.policy if r.admission == "reject" or r.policy != "goodput" else "goodput (best_effort)"
        lines.append(f"{label:<23}{r.attainment:>11.1%}{r.admitted_attainment:>11.1%}{r.goodput_rps:>10.2f} r/s"
                     f"{r.rejected:>10d}{r.ttft_p90_s:>9.2f}s{r.tpot_p90_s:>9.3f}s")
    return "\n".join(lines)


class RateSweep(NamedTuple):
    label: str  # policy, with "(best_effort)" for goodput serving everything
    rates: tuple[float, ...]
    attainment: tuple[float, ...]  # of all requests, per rate
    goodput_rps: float  # highest swept rate with attainment >= the target (0 if none)


def sweep_rates(rates: Sequence[float], pools: Pools, latency: LatencyModel, slo: SLOConfig, *, n: int = 600,
                cv: float = 3.0, seed: int = 0, target: float = 0.9) -> list[RateSweep]:
    """DistServe-style goodput: the highest rate at which `target` of all requests meet both SLOs,
    per policy, on the same trace shape at every rate (common random numbers)."""
    if not rates or not 0 < target <= 1:
        raise ValueError(f"sweep_rates needs rates and 0 < target <= 1, got {list(rates)} and {target}")
    curves: dict[str, list[float]] = {}
    for rate in rates:
        for r in compare_policies(bursty_trace(n, rate, cv, seed), pools, latency, slo):
            label = r.policy + (" (best_effort)" if r.admission == "best_effort" else "")
            curves.setdefault(label, []).append(r.attainment)
    return [RateSweep(label, tuple(rates), tuple(att), max((x for x, a in zip(rates, att, strict=True)
                                                          if a >= target), default=0.0))
            for label, att in curves.items()]


def format_sweep(rows: Sequence[RateSweep], target: float = 0.9) -> str:
    head = f"{'policy':<23}" + "".join(f"{x:>8g}" for x in rows[0].rates) + f"   req/s at {target:.0%}"
    lines = [f"attainment per arrival rate (req/s) and the highest rate with {target:.0%} attainment", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r.label:<23}" + "".join(f"{a:>8.1%}" for a in r.attainment) + f"   {r.goodput_rps:g} req/s")
    return "\n".join(lines)
