"""Goodput routing policy: predict a request's TTFT and TPOT on the prefill and decode workers and pick
the pair most likely to meet both targets, or refuse (admit=False) when none is likely to.

Prediction, from placement's LatencyModel and each worker's live WorkerStats:

    TTFT(p, d) = r_p * prefill(tokens queued on p + prompt; one fixed cost per batch) + kv_transfer(prompt)
    step(d)    = r_d * decode_step(B + 1, C + prompt + max_tokens / 2)     (B, C: batch and context on d)
    TPOT(d)    = step(d) + KV wait / (max_tokens - 1)       (a wait only when d's free KV cannot hold us)
    P(meet)    = Phi(ln(target / predicted) / sigma)         (log-normal prediction error)

`r_p`, `r_d` are per-worker EWMAs of observed/predicted ratios, fed by `observe` after each request and,
for decode workers, by their recent step times. Requests this policy routed that a worker's stats do
not show yet (stats lag one refresh; a request reaches decode only after its prefill) are added from
a per-worker ledger. A pair scores P(TTFT) x P(TPOT) x P(the decode batch already there stays within
the default TPOT). Ties go to the prefill worker that last served the prompt's prefix (prefix-cache
affinity), then to the least loaded (lowest prediction).
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
from placement.latency import LatencyModel

if TYPE_CHECKING:
    from cluster.config import RouterConfig, SLOConfig

logger = logging.getLogger(__name__)

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _ewma(ratio: float, observed_over_predicted: float, alpha: float) -> float:
    """Move `ratio` toward ratio x observed/predicted in log space; one sample moves it at most 3x^alpha."""
    step = min(3.0, max(1 / 3, observed_over_predicted))
    return min(10.0, max(0.1, ratio * step**alpha))


class WorkerState:
    """What the policy remembers about one worker: correction ratios, and the requests it routed there
    that the worker's stats do not show yet or that are still waiting for their first token."""

    __slots__ = ("ttft_ratio", "tpot_ratio", "step_ratio", "step_ts", "led", "led_tokens", "led_key",
                 "min_deadline", "inc", "inc_kv", "inc_ctx")

    def __init__(self) -> None:
        self.ttft_ratio = self.tpot_ratio = self.step_ratio = 1.0
        self.step_ts = -1.0
        self.led: deque[tuple[float, int, float]] = deque()  # prefill: (routed at, prompt, prefill deadline)
        self.led_tokens = 0
        self.led_key: tuple[float, int, int] | None = None
        self.min_deadline = math.inf
        self.inc: list[tuple[float, int, int]] = []  # decode: heap of (expected arrival, KV tokens, context)
        self.inc_kv = 0
        self.inc_ctx = 0

    def prefill_view(self, s: WorkerStats, cut: float) -> tuple[int, int, float]:
        """(tokens, requests) routed here after the stats snapshot, and the earliest prefill deadline of
        our requests that are queued (not in the running batch), which a newcomer would delay."""
        led = self.led
        ts = s.timestamp_s
        un_t = un_n = 0
        for e in reversed(led):
            if e[0] <= ts:
                break
            un_t += e[1]
            un_n += 1
        # NOTE: prefill is FIFO, so the pending tokens are our newest routes (plus other ingresses').
        pending = s.queued_prompt_tokens + un_t
        while led and (self.led_tokens - led[0][1] >= pending or led[0][0] < cut):
            self.led_tokens -= led.popleft()[1]
        key = (ts, len(led), s.running)
        if key != self.led_key:
            self.led_key = key
            self.min_deadline = min((e[2] for e in itertools.islice(led, s.running, None)), default=math.inf)
        return un_t, un_n, self.min_deadline

    def incoming(self, stats_ts: float, cut: float) -> int:
        """Requests on their way to this decode worker (prefill or KV transfer still running)."""
        h = self.inc
        while h and (h[0][0] <= stats_ts or h[0][0] < cut):
            _, kv, ctx = heapq.heappop(h)
            self.inc_kv -= kv
            self.inc_ctx -= ctx
        return len(h)

    def calibrate_step(self, s: WorkerStats, lat: LatencyModel, alpha: float) -> None:
        self.step_ts = s.timestamp_s
        steps = s.recent_step_times_s
        if s.running < 1 or len(steps) < 4:
            return
        recent = sorted(steps[-8:])
        model = lat.decode_step_time_s(s.running, s.running_context_tokens)
        if model > 0:
            self.step_ratio = _ewma(self.step_ratio, recent[len(recent) // 2] / model / self.step_ratio, alpha)


class GoodputPolicy:
    """`policy(req, prefill_stats, decode_stats) -> RouteDecision`; `observe(...)` after each request.

    The decision names the best pair also when `admit` is False, so best-effort admission can serve it
    anyway; `record_refused=True` (best-effort deployments) books refused requests on that pair.
    Colocated mode: `prefill` is empty and `decode` holds the colocated workers.
    """

    def __init__(self, latency: LatencyModel, *, decode_latency: LatencyModel | None = None,
                 default_ttft_s: float = 2.0, default_tpot_s: float = 0.2, sigma: float = 0.25,
                 admit_probability: float = 0.5, ewma_alpha: float = 0.1, max_prefill_tokens: int = 4096,
                 tie_probability: float = 0.02, affinity_entries: int = 4096, record_refused: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        for name, v, lo, hi in (("sigma", sigma, 1e-3, 5.0), ("admit_probability", admit_probability, 0.0, 1.0),
                                ("ewma_alpha", ewma_alpha, 1e-6, 1.0), ("tie_probability", tie_probability, 0, 1),
                                ("default_ttft_s", default_ttft_s, 1e-6, 1e6),
                                ("default_tpot_s", default_tpot_s, 1e-6, 1e6)):
            if not lo <= v <= hi:
                raise ValueError(f"goodput policy: {name}={v!r} must be in [{lo}, {hi}]")
        if max_prefill_tokens < 1 or affinity_entries < 1:
            raise ValueError(f"goodput policy: max_prefill_tokens={max_prefill_tokens} and "
                             f"affinity_entries={affinity_entries} must be >= 1")
        self.latency = latency
        self.decode_latency = decode_latency or latency
        self.default_ttft_s = default_ttft_s
        self.default_tpot_s = default_tpot_s
        self.sigma = sigma
        self.admit_probability = admit_probability
        self.alpha = ewma_alpha
        self.max_prefill_tokens = max_prefill_tokens
        self.tie_probability = tie_probability
        self.record_refused = record_refused
        self.clock = clock
        self.stale_s = 30.0  # ledger entries older than this go even if a worker's stats never refresh
        self.states: dict[str, WorkerState] = {}
        self._inv = _INV_SQRT2 / sigma
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
        if target <= 0.0 or predicted == math.inf:
            return 0.0
        if predicted <= 0.0:
            return 1.0
        return 0.5 + 0.5 * math.erf(math.log(target / predicted) * self._inv)

    def _state(self, wid: str) -> WorkerState:
        st = self.states.get(wid)
        if st is None:
            st = self.states[wid] = WorkerState()
        return st

    # ---- one decision -------------------------------------------------------------------------------
    def _prefill_scan(self, req: RouteRequest, workers: Sequence[WorkerStats], now: float, aff: str | None,
                      x_cross: float, x_same: float) -> tuple[list[float], list[float], int, int, dict]:
        """Per worker: predicted queue wait + own prefill (s) and score P(TTFT) x P(queued requests we
        would delay still meet theirs), with a cross-node transfer. Also the best index, the affinity
        worker's index (-1 if absent) and {node: (score with a same-node transfer, index)}."""
        t = self.latency.terms
        pa, pb, p_mem, p_fixed, p_lin = t.pa, t.pb, t.p_mem, t.p_fixed, t.p_lin
        prompt, slo = req.prompt_tokens, req.ttft_slo_s
        maxb = self.max_prefill_tokens
        p2 = prompt * prompt
        own = pa * prompt + pb * p2 + p_lin * prompt  # what we add to the batch we join
        cut = now - self.stale_s
        states, p_meet = self.states, self.p_meet
        costs: list[float] = []
        scores: list[float] = []
        best, aff_i, by_node = 0, -1, {}
        for i, s in enumerate(workers):
            wid = s.worker_id
            st = states.get(wid) or self._state(wid)
            q = s.queued_prompt_tokens
            n = s.waiting + s.running
            deadline = math.inf
            if st.led:
                dq, dn, deadline = st.prefill_view(s, cut)
                q += dq
                n += dn
            total = q + prompt
            c = pa * total + pb * ((q * q / n if n else q * q) + p2)  # NOTE: queued lengths assumed equal
            if c < p_mem:
                c = p_mem
            r = st.ttft_ratio
            c = (c + p_fixed * (1 + (total - 1) // maxb) + p_lin * total) * r
            sc = p_meet(slo, c + x_cross)
            if deadline != math.inf:
                before = p_meet(deadline - now, c - own * r)
                if before > 0.01:
                    sc *= p_meet(deadline - now, c) / before
            costs.append(c)
            scores.append(sc)
            if sc > scores[best] or (sc == scores[best] and c < costs[best]):
                best = i
            if wid == aff:
                aff_i = i
            if s.node_id:
                same = sc if x_same == x_cross else sc * p_meet(slo, c + x_same) / max(p_meet(slo, c + x_cross), 1e-12)
                if same > by_node.get(s.node_id, (-1.0, 0))[0]:
                    by_node[s.node_id] = (same, i)
        return costs, scores, best, aff_i, by_node

    def __call__(self, req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]
                 ) -> RouteDecision:
        if req.prompt_tokens < 0 or req.max_tokens < 1:
            raise ValueError(f"route request needs prompt_tokens >= 0 and max_tokens >= 1, got "
                             f"{req.prompt_tokens} and {req.max_tokens}")
        if not decode:
            return RouteDecision(False, None, None, "no decode workers")
        now = self.clock()
        colocated = not prefill
        prompt, out = req.prompt_tokens, req.max_tokens
        aff = self._affinity.get(req.prefix_hash) if req.prefix_hash and not colocated else None
        x_cross = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, False)
        x_same = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, True)
        costs, scores, best_p, aff_i, by_node = self._prefill_scan(
            req, decode if colocated else prefill, now, aff, x_cross, x_same)
        pt_any = scores[best_p]
        lat = self.decode_latency
        cut = now - self.stale_s
        need = prompt + out
        ctx_new = prompt + out // 2
        guard = self.default_tpot_s < req.tpot_slo_s  # the batch already there has a tighter target
        best = (-1.0, math.inf, 0, 0.0, 0.0, 0)  # score, tpot, decode index, step, TTFT, prefill index
        for j, s in enumerate(decode):
            st = self.states.get(s.worker_id) or self._state(s.worker_id)
            if s.timestamp_s != st.step_ts and s.role == "decode":
                st.calibrate_step(s, lat, self.alpha)
            in_n = st.incoming(s.timestamp_s, cut) if st.inc else 0
            ahead = s.running + s.waiting + in_n
            step = lat.decode_step_time_s(ahead + 1, s.running_context_tokens + s.queued_prompt_tokens
                                          + st.inc_ctx + ctx_new) * st.tpot_ratio * st.step_ratio
            cap = s.kv_capacity_tokens
            free = cap - s.kv_usage * cap - s.queued_prompt_tokens - s.waiting * self._avg_out - st.inc_kv
            if cap and need > cap:
                tpot = math.inf
            elif cap and need > free:
                # NOTE: KV frees as running requests finish; each holds its KV for ~avg_out steps.
                tpot = step + (need - free) * self._avg_out * step / max(cap - free, 1.0) / max(out - 1, 1)
            else:
                tpot = step
            if colocated:
                pi, pt, ttft = j, scores[j], costs[j]
            elif s.node_id in by_node and by_node[s.node_id][0] > pt_any:
                pt, pi = by_node[s.node_id]
                ttft = costs[pi] + x_same
            else:
                pi, pt, ttft = best_p, pt_any, costs[best_p] + x_cross
            score = pt if out <= 1 else pt * self.p_meet(req.tpot_slo_s, tpot)
            if guard and ahead and out > 1:
                score *= self.p_meet(self.default_tpot_s, step)
            if score > best[0] or (score == best[0] and tpot < best[1]):
                best = (score, tpot, j, step, ttft, pi)
        score, tpot, j, step, ttft, pi = best
        d = decode[j]
        if aff_i >= 0 and aff_i != pi:
            same = bool(d.node_id) and prefill[aff_i].node_id == d.node_id
            x = x_same if same else x_cross
            pt_aff = scores[aff_i] * self.p_meet(req.ttft_slo_s, costs[aff_i] + x) / max(
                self.p_meet(req.ttft_slo_s, costs[aff_i] + x_cross), 1e-12)
            pt = pt_any if ttft == costs[pi] + x_cross else by_node[d.node_id][0]
            if pt_aff >= pt - self.tie_probability:
                score = score / pt * pt_aff if pt > 0 else score
                pi, ttft = aff_i, costs[aff_i] + x
        p = None if colocated else prefill[pi]
        admit = score >= self.admit_probability and score > 0
        if admit or self.record_refused:
            self._record(req, p, d, now, ttft, need, ctx_new, ttft - costs[pi])
        reason = (f"goodput P(slo)={score:.3f}" if admit else
                  f"no pair meets the targets (best P(slo)={score:.3f}: TTFT {ttft:.3f} s vs {req.ttft_slo_s:.3f} s, "
                  f"TPOT {tpot:.3f} s vs {req.tpot_slo_s:.3f} s)")
        return RouteDecision(admit, p.worker_id if p else None, d.worker_id, reason, ttft,
                             tpot if out > 1 else None, score)

    def _record(self, req: RouteRequest, p: WorkerStats | None, d: WorkerStats, now: float, ttft: float,
                need: int, ctx: int, transfer: float) -> None:
        ps = self.states[p.worker_id if p else d.worker_id]
        ps.led.append((now, req.prompt_tokens, now + req.ttft_slo_s - transfer))
        ps.led_tokens += req.prompt_tokens
        self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
        if p is None:
            return
        if req.max_tokens > 1:
            ds = self.states[d.worker_id]
            heapq.heappush(ds.inc, (now + ttft, need, ctx))
            ds.inc_kv += need
            ds.inc_ctx += ctx
        if req.prefix_hash:
            self._affinity[req.prefix_hash] = p.worker_id
            self._affinity.move_to_end(req.prefix_hash)
            if len(self._affinity) > self._affinity_entries:
                self._affinity.popitem(last=False)

    def observe(self, decision: RouteDecision, route: RouteRequest, ttft_s: float, tpot_s: float | None) -> None:
        """Feedback after a request: move the serving workers' correction ratios toward observed/predicted."""
        pred = decision.predicted_ttft_s
        wid = decision.prefill or decision.decode
        if wid and pred and math.isfinite(pred) and ttft_s > 0:
            st = self._state(wid)
            st.ttft_ratio = _ewma(st.ttft_ratio, ttft_s / pred, self.alpha)
        pred = decision.predicted_tpot_s
        if decision.decode and pred and math.isfinite(pred) and tpot_s:
            st = self._state(decision.decode)
            st.tpot_ratio = _ewma(st.tpot_ratio, tpot_s / pred, self.alpha)


POLICIES["goodput"] = GoodputPolicy.from_config
