"""Goodput routing policy: predict a request's TTFT and TPOT on the prefill and decode workers and pick
the pair most likely to meet both targets, or refuse (admit=False) when none is likely to.

From placement's LatencyModel and each worker's WorkerStats (docs/router.md has the details):

    TTFT(p, d) = r_p * (prefill(tokens queued on p + prompt, a fixed cost per batch) - half the running
                 batch) + kv_transfer(prompt, same node?)
    step(d)    = r_d * decode_step(B + 1, C + prompt + max_tokens / 2)      (B, C: batch and context on d)
    TPOT(d)    = step(d) + KV wait / (max_tokens - 1)       (a wait only when d's free KV cannot hold us)
    P(meet)    = Phi(ln(target / predicted) / sigma)         (log-normal prediction error)
    value      = P(TTFT) x P(TPOT) - harm    (harm: the chance we cost a request we would delay)

`r_p`, `r_d` are per-worker EWMAs of observed/predicted ratios (`observe`, and decode step times).
Requests routed here that a worker's stats do not show yet are added from per-worker ledgers. The
pair with the highest value wins; ties go to the prefill worker that last served the prompt's prefix
(prefix-cache affinity), then to the lower prediction (load). Per worker, the request-independent
part of each prediction is cached until its stats or ledger change, so a decision costs a few
multiplications per worker.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cluster.router import POLICIES, RouteDecision, RouteRequest, latency_from_config
from engine.stats import WorkerStats
from placement.latency import LatencyModel, Terms

if TYPE_CHECKING:
    from cluster.config import RouterConfig, SLOConfig

logger = logging.getLogger(__name__)
_INF = math.inf


def _ewma(ratio: float, observed_over_predicted: float, alpha: float) -> float:
    """Move `ratio` toward ratio x observed/predicted in log space (one sample moves it at most 3^alpha)."""
    return min(10.0, max(0.1, ratio * min(3.0, max(1 / 3, observed_over_predicted)) ** alpha))


class WorkerState:
    """One worker as the policy sees it: correction ratios, ledgers of what it routed there, and the
    request-independent parts of its predictions (valid while `pstats`/`dstats` is the stats object)."""

    __slots__ = ("ttft_ratio", "tpot_ratio", "step_ratio", "pstats", "dstats", "led", "led_tokens", "q",
                 "base", "extra", "deadline", "inc", "inc_kv", "inc_ctx", "b0", "c0", "free", "kvf", "cap", "dr")

    def __init__(self) -> None:
        self.ttft_ratio = self.tpot_ratio = self.step_ratio = 1.0
        self.pstats: WorkerStats | None = None
        self.dstats: WorkerStats | None = None
        self.led: deque[tuple[float, int, float]] = deque()  # (routed at, prompt, prefill deadline)
        self.led_tokens = self.q = 0
        self.base = self.extra = 0.0
        self.deadline = _INF
        self.inc: list[tuple[float, int, int]] = []  # heap of (expected arrival, KV tokens, context)
        self.inc_kv = self.inc_ctx = self.b0 = self.c0 = 0
        self.free = self.kvf = self.cap = self.dr = 0.0

    def refresh_prefill(self, s: WorkerStats, t: Terms, cut: float) -> None:
        """Queue as prediction terms: base = pa*q + pb*sum(l^2) (lengths assumed equal), extra = p_lin*q
        minus half the running batch; `deadline`: the tightest prefill deadline we would delay."""
        self.pstats = s
        led, ts = self.led, s.timestamp_s
        un_t = un_n = 0
        for e in reversed(led):  # routed after the snapshot
            if e[0] <= ts:
                break
            un_t, un_n = un_t + e[1], un_n + 1
        # NOTE: prefill is FIFO, so the pending tokens are our newest routes (plus other ingresses').
        pending = s.queued_prompt_tokens + un_t
        while led and (self.led_tokens - led[0][1] >= pending or led[0][0] < cut):
            self.led_tokens -= led.popleft()[1]
        self.deadline = min((e[2] for e in itertools.islice(led, s.running, None)), default=_INF)
        q, n, run = pending, s.waiting + s.running + un_n, s.running
        self.q = q
        self.base = t.pa * q + t.pb * (q * q / n if n else q * q)
        self.extra = t.p_lin * q
        if run and n:  # NOTE: the running batch is half done on average when we arrive
            qi = q * run / n
            self.extra -= 0.5 * (t.pa * qi + t.pb * qi * qi / run + t.p_fixed + t.p_lin * qi)

    def refresh_decode(self, s: WorkerStats, lat: LatencyModel, alpha: float, cut: float, avg_out: float) -> None:
        self.dstats = s
        steps = s.recent_step_times_s
        if s.role == "decode" and s.running and len(steps) >= 4:
            recent = sorted(steps[-8:])
            model = lat.decode_step_time_s(s.running, s.running_context_tokens)
            if model > 0:
                self.step_ratio = _ewma(self.step_ratio, recent[len(recent) // 2] / model / self.step_ratio, alpha)
        h = self.inc
        while h and (h[0][0] <= s.timestamp_s or h[0][0] < cut):  # arrived, so in the stats now
            _, kv, ctx = heapq.heappop(h)
            self.inc_kv -= kv
            self.inc_ctx -= ctx
        self.b0 = s.running + s.waiting + len(h)
        self.c0 = s.running_context_tokens + s.queued_prompt_tokens + self.inc_ctx
        cap = s.kv_capacity_tokens
        self.cap = cap or _INF  # NOTE: 0 = unknown capacity, never a KV wait
        self.free = cap * (1.0 - s.kv_usage) - s.queued_prompt_tokens - self.inc_kv - s.waiting * avg_out if cap else _INF
        self.kvf = avg_out / max(cap - self.free, 1.0) if cap else 0.0  # wait steps per missing KV token
        self.dr = self.tpot_ratio * self.step_ratio


class GoodputPolicy:
    """`policy(req, prefill_stats, decode_stats) -> RouteDecision`; `observe(...)` after each request.

    The decision names the best pair also when `admit` is False, so best-effort admission can serve it
    anyway; `record_refused=True` (best-effort deployments) books refused requests on that pair.
    Colocated mode: `prefill` is empty and `decode` holds the colocated workers (no KV transfer).
    """

    def __init__(self, latency: LatencyModel, *, decode_latency: LatencyModel | None = None,
                 default_ttft_s: float = 2.0, default_tpot_s: float = 0.2, sigma: float = 0.25,
                 admit_probability: float = 0.5, ewma_alpha: float = 0.1, max_prefill_tokens: int = 4096,
                 tie_probability: float = 0.02, affinity_entries: int = 4096, record_refused: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        for name, v, lo, hi in (("sigma", sigma, 1e-3, 5.0), ("admit_probability", admit_probability, 0.0, 1.0),
                                ("ewma_alpha", ewma_alpha, 1e-6, 1.0), ("tie_probability", tie_probability, 0, 1),
                                ("default_ttft_s", default_ttft_s, 1e-6, 1e6),
                                ("default_tpot_s", default_tpot_s, 1e-6, 1e6),
                                ("max_prefill_tokens", max_prefill_tokens, 1, 1e9),
                                ("affinity_entries", affinity_entries, 1, 1e9)):
            if not lo <= v <= hi:
                raise ValueError(f"goodput policy: {name}={v!r} must be in [{lo}, {hi:g}]")
        self.latency = latency
        self.decode_latency = decode_latency or latency
        self.default_ttft_s, self.default_tpot_s = default_ttft_s, default_tpot_s
        self.sigma, self.admit_probability, self.alpha = sigma, admit_probability, ewma_alpha
        self.max_prefill_tokens = max_prefill_tokens
        self.tie_probability = tie_probability
        self.record_refused = record_refused
        self.clock = clock
        self.stale_s = 30.0  # ledger entries older than this go even if a worker's stats never refresh
        self.states: dict[str, WorkerState] = {}
        self._inv = 1.0 / (sigma * math.sqrt(2.0))
        self._sat = math.exp(6.0 / self._inv)
        self._affinity: OrderedDict[int, str] = OrderedDict()
        self._affinity_entries = affinity_entries
        self._avg_out = 128.0

    @classmethod
    def from_config(cls, *, router_cfg: RouterConfig | None = None, slo: SLOConfig | None = None,
                    latency: LatencyModel | None = None, **kwargs: Any) -> GoodputPolicy:
        """Build from the deploy config's `router` and `slo` sections (what `make_policy` calls)."""
        if router_cfg is not None:
            kwargs.setdefault("sigma", router_cfg.prediction_sigma)
            kwargs.setdefault("admit_probability", router_cfg.admit_probability)
            kwargs.setdefault("ewma_alpha", router_cfg.ewma_alpha)
            kwargs.setdefault("record_refused", router_cfg.admission == "best_effort")
        if slo is not None:
            kwargs.setdefault("default_ttft_s", slo.ttft_ms / 1000.0)
            kwargs.setdefault("default_tpot_s", slo.tpot_ms / 1000.0)
        lat = latency or latency_from_config(router_cfg)
        logger.info("goodput router using %r", lat)
        return cls(lat, **kwargs)

    def p_meet(self, target: float, predicted: float) -> float:
        """P(actual <= target) when actual = predicted x lognormal(0, sigma)."""
        if target >= predicted * self._sat:  # erf rounds to 1 (also for predicted <= 0)
            return 1.0
        if target <= 0.0 or predicted == _INF:
            return 0.0
        return 0.5 + 0.5 * math.erf(math.log(target / predicted) * self._inv)

    def _state(self, wid: str) -> WorkerState:
        st = self.states.get(wid)
        if st is None:
            st = self.states[wid] = WorkerState()
        return st

    def _prefill_scan(self, prompt: int, workers: Sequence[WorkerStats], now: float, aff: str | None
                      ) -> tuple[list[float], int, list[int], int, dict[str, int]]:
        """Predicted queue wait + own prefill per worker (s); the lowest among workers where we would
        delay none of our queued requests (-1: none), the others ("held"), the affinity worker's index
        and {node: index of its lowest}."""
        t = self.latency.terms
        p_mem, p_fixed, maxb = t.p_mem, t.p_fixed, self.max_prefill_tokens
        fl, tail, pm1 = t.pa * prompt + t.pb * prompt * prompt, t.p_lin * prompt, prompt - 1
        cut, get = now - self.stale_s, self.states.get
        costs: list[float] = []
        best, best_c, held, aff_i, by_node = -1, _INF, [], -1, {}
        for i, s in enumerate(workers):
            st = get(s.worker_id) or self._state(s.worker_id)
            if st.pstats is not s:
                st.refresh_prefill(s, t, cut)
            lin = st.base + fl
            c = ((lin if lin > p_mem else p_mem) + p_fixed * (1 + (st.q + pm1) // maxb) + st.extra + tail) * st.ttft_ratio
            costs.append(c)
            if st.deadline != _INF:
                held.append(i)
            elif c < best_c:
                best, best_c = i, c
            if s.worker_id == aff:
                aff_i = i
            nid = s.node_id
            if nid:
                k = by_node.get(nid)
                if k is None or c < costs[k]:
                    by_node[nid] = i
        return costs, best, held, aff_i, by_node

    def _ttft_terms(self, st: WorkerState, c: float, x: float, req: RouteRequest, now: float) -> tuple[float, float]:
        """(P(our TTFT), harm: how much we lower the chance of the tightest queued request we delay)."""
        pt = self.p_meet(req.ttft_slo_s, c + x)
        if st.deadline == _INF:
            return pt, 0.0
        t = self.latency.terms
        own = (t.pa * req.prompt_tokens + t.pb * req.prompt_tokens ** 2 + t.p_lin * req.prompt_tokens) * st.ttft_ratio
        slack = st.deadline - now
        return pt, self.p_meet(slack, c - own) - self.p_meet(slack, c)

    def __call__(self, req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]
                 ) -> RouteDecision:
        prompt, out = req.prompt_tokens, req.max_tokens
        if prompt < 0 or out < 1:
            raise ValueError(f"route request needs prompt_tokens >= 0 and max_tokens >= 1, got {prompt} and {out}")
        if not decode:
            return RouteDecision(False, None, None, "no decode workers")
        now = self.clock()
        colocated = not prefill
        aff = self._affinity.get(req.prefix_hash) if req.prefix_hash and not colocated else None
        pool = decode if colocated else prefill
        costs, nh, held, aff_i, by_node = self._prefill_scan(prompt, pool, now, aff)
        x_cross = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, False)
        x_same = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, True)
        memo: dict[tuple[int, float], tuple[float, float]] = {}

        def ttft(i: int, x: float) -> tuple[float, float]:
            r = memo.get((i, x))
            if r is None:
                r = memo[(i, x)] = self._ttft_terms(self.states[pool[i].worker_id], costs[i], x, req, now)
            return r

        best_p, best_v = nh, (ttft(nh, x_cross)[0] if nh >= 0 else -_INF)
        held.sort(key=costs.__getitem__)
        for i in held:  # NOTE: value <= P(own TTFT), which falls with the cost: stop once it cannot win
            if (nh >= 0 and costs[i] >= costs[nh]) or self.p_meet(req.ttft_slo_s, costs[i] + x_cross) < best_v:
                break
            pt, harm = ttft(i, x_cross)
            if pt - harm > best_v or (pt - harm == best_v and costs[i] < costs[best_p]):
                best_p, best_v = i, pt - harm
        # Decode: the lowest TPOT per node (per worker when colocated or guarding the batch there).
        t, lat, get, cut = self.decode_latency.terms, self.decode_latency, self.states.get, now - self.stale_s
        dmc, dma, dcb, dca, dfix, dlin = t.d_mem_c, t.d_mem_a, t.d_comp_b, t.d_comp_a, t.d_fixed, t.d_lin
        need, ctx_new, avg, inv_om1 = prompt + out, prompt + out // 2, self._avg_out, 1.0 / max(out - 1, 1)
        guard = self.default_tpot_s < req.tpot_slo_s and out > 1  # the batch there has a tighter target
        groups: dict[object, tuple[float, int, float]] = {}
        for j, s in enumerate(decode):
            st = get(s.worker_id) or self._state(s.worker_id)
            if st.dstats is not s:
                st.refresh_decode(s, lat, self.alpha, cut, avg)
            b, c = st.b0 + 1, st.c0 + ctx_new
            mem, comp = dmc + dma * c, dcb * b + dca * c
            step = ((mem if mem > comp else comp) + dfix + dlin * b) * st.dr
            if need <= st.free:
                tpot = step
            elif need > st.cap:
                tpot = _INF
            else:  # NOTE: KV frees as requests finish; each holds its KV for ~avg_out steps
                tpot = step * (1.0 + (need - st.free) * st.kvf * inv_om1)
            key = j if colocated or guard else s.node_id
            g = groups.get(key)
            if g is None or tpot < g[0]:
                groups[key] = (tpot, j, step)
        best = (-_INF, _INF, 0, 0, 0.0, 0.0)  # value, TPOT, decode index, prefill index, P(own), transfer
        for tpot, j, step in groups.values():
            d = decode[j]
            pi, x = (j, 0.0) if colocated else (best_p, x_cross)
            nb = by_node.get(d.node_id, -1) if d.node_id and not colocated else -1
            if nb == best_p:
                x = x_same
            elif nb >= 0 and self.p_meet(req.ttft_slo_s, costs[nb] + x_same) > best_v:
                pt, harm = ttft(nb, x_same)
                if pt - harm > best_v:
                    pi, x = nb, x_same
            pt, harm = ttft(pi, x)
            p_own = pt if out <= 1 else pt * self.p_meet(req.tpot_slo_s, tpot)
            value = p_own - harm
            st = self.states[d.worker_id]
            if guard and st.b0:
                before = step * lat.decode_step_time_s(st.b0, st.c0) / lat.decode_step_time_s(st.b0 + 1, st.c0 + ctx_new)
                value -= st.b0 * (self.p_meet(self.default_tpot_s, before) - self.p_meet(self.default_tpot_s, step))
            if value > best[0] or (value == best[0] and tpot < best[1]):
                best = (value, tpot, j, pi, p_own, x)
        value, tpot, j, pi, p_own, x = best
        d = decode[j]
        if aff_i >= 0 and aff_i != pi:
            xa = x_same if d.node_id and prefill[aff_i].node_id == d.node_id else x_cross
            (pt, harm), (pt_a, harm_a) = ttft(pi, x), ttft(aff_i, xa)
            if pt > 0 and pt_a - harm_a >= pt - harm - self.tie_probability:
                p_own, value = p_own / pt * pt_a, value + (pt_a - harm_a) - (pt - harm)
                pi, x = aff_i, xa
        ttft_s = costs[pi] + x
        admit = p_own >= self.admit_probability and value > 0
        p_id = None if colocated else prefill[pi].worker_id
        if admit or self.record_refused:
            self._record(req, self.states[pool[pi].worker_id], self.states[d.worker_id], p_id, now, ttft_s, x)
        reason = "goodput" if admit else (
            f"no pair meets the targets: best P(slo)={p_own:.3f} (net of others {value:.3f}), TTFT "
            f"{ttft_s:.3f} s vs {req.ttft_slo_s:.3f} s, TPOT {tpot:.3f} s vs {req.tpot_slo_s:.3f} s")
        return RouteDecision(admit, p_id, d.worker_id, reason, ttft_s, tpot if out > 1 else None, p_own)

    def _record(self, req: RouteRequest, ps: WorkerState, ds: WorkerState, p_id: str | None, now: float,
                ttft: float, transfer: float) -> None:
        ps.led.append((now, req.prompt_tokens, now + req.ttft_slo_s - transfer))
        ps.led_tokens += req.prompt_tokens
        ps.pstats = None  # NOTE: its cached prediction terms are stale now
        self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
        if p_id is None:
            return
        if req.max_tokens > 1:
            need, ctx = req.prompt_tokens + req.max_tokens, req.prompt_tokens + req.max_tokens // 2
            heapq.heappush(ds.inc, (now + ttft, need, ctx))
            ds.inc_kv += need
            ds.inc_ctx += ctx
            ds.dstats = None
        if req.prefix_hash:
            self._affinity[req.prefix_hash] = p_id
            self._affinity.move_to_end(req.prefix_hash)
            if len(self._affinity) > self._affinity_entries:
                self._affinity.popitem(last=False)

    def observe(self, decision: RouteDecision, route: RouteRequest, ttft_s: float, tpot_s: float | None) -> None:
        """Feedback after a request: move the serving workers' correction ratios toward observed/predicted."""
        pred, wid = decision.predicted_ttft_s, decision.prefill or decision.decode
        if wid and pred and math.isfinite(pred) and ttft_s > 0:
            st = self._state(wid)
            st.ttft_ratio, st.pstats = _ewma(st.ttft_ratio, ttft_s / pred, self.alpha), None
        pred = decision.predicted_tpot_s
        if decision.decode and pred and math.isfinite(pred) and tpot_s:
            st = self._state(decision.decode)
            st.tpot_ratio, st.dstats = _ewma(st.tpot_ratio, tpot_s / pred, self.alpha), None


POLICIES["goodput"] = GoodputPolicy.from_config
