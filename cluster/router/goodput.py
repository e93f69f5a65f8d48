"""Goodput routing policy: predict a request's TTFT and TPOT on the prefill and decode workers and pick
the pair most likely to meet both targets, or refuse (admit=False) when none is likely to.

From placement's LatencyModel and each worker's WorkerStats (docs/router.md has the details):

    TTFT(p, d) = r_p * (prefill(tokens queued on p + prompt, a fixed cost per batch) - half the running
                 batch) [+ kv_transfer(prompt, same node?) when the decode engine samples token 1]
    step(d)    = r_d * decode_step(B + 1, C + prompt + max_tokens / 2) / (1 - share_d)
                 (B, C: batch and context on d, B at least the batch the decode work routed there over the last
                 10 s settles at, tau x step by Little's law; share_d, colocated only: the share of d's time the prompts
                 routed there took over the last 10 s; a decode worker's local prefills are in the step times
                 its step correction r_d learns from)
    TPOT(d)    = step(d) + (KV wait + kv_transfer) / (max_tokens - 1)
                 (a KV wait only when d's free KV cannot hold us; the transfer delays the second token when
                 the prefill's first token is the client's)
    P(meet)    = Phi(ln(target / predicted) / sigma)         (log-normal prediction error)
    value      = P(TTFT) x P(TPOT) - harm    (harm: the chances of meeting their targets that our
                 queued requests on p, or the batch on d, would lose because of us)

`r_p`, `r_d` are per-worker EWMAs of observed/predicted ratios (`observe`, and decode step times); r_d is the
step correction x the TPOT correction, which applies in full from the batch it was learnt at and in part below
it (what the step model leaves out, the stalls of the prefills that came with the streams, grows with the
batch: WorkerState.tpot_correction).
An engine prefills the prompts waiting together in one step, so a request routed later to the same step
ends it later for all of them: the earlier ones' TTFT predictions are revised to its end before `observe`
compares them with what happened (`_revise`).
Requests routed here that a worker's stats do not show yet are added from per-worker ledgers. The
pair with the highest value wins; ties go to the prefill worker that last served the prompt's prefix
(prefix-cache affinity), then to the lower prediction (load). Per worker, the request-independent
part of each prediction is cached until its stats or ledger change, so a decision costs a few
multiplications per worker.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cluster.router.goodput_state import _INF, WorkerState, _learn
from cluster.router.latency import latency_from_config
from cluster.router.local_prefill import Declined, LocalPrefill
from cluster.router.policy import Corrections, Policy, RouteDecision, RouteRequest, register
from engine.contract import WorkerStats
from placement.latency import LatencyModel, Terms

TICKETS = 4096  # TTFT predictions kept for revision until their request is observed (oldest dropped first)

if TYPE_CHECKING:
    from cluster.config import RouterConfig, SLOConfig
    from placement.config import Coefficients

logger = logging.getLogger(__name__)


def _own(t: Terms, prompt: int, hit: int) -> tuple[float, float]:
    """What a prompt adds to the prefill batch it joins with `hit` of its tokens in the prefix cache: the
    roofline part (GEMMs on the new tokens, attention over the whole prompt) and the per-token tail."""
    new = prompt - hit
    return t.pa * new + t.pb * (prompt * prompt - hit * hit), t.p_lin * new


class GoodputPolicy(LocalPrefill, Policy):
    """`policy(req, prefill_stats, decode_stats) -> RouteDecision`; `observe(...)` after each request.

    The decision names the best pair also when `admit` is False, so best-effort admission can serve it
    anyway; `record_refused=True` (best-effort deployments) books refused requests on that pair.
    Colocated mode: `prefill` is empty and `decode` holds the colocated workers (no KV transfer).
    """

    def __init__(self, latency: LatencyModel, *, decode_latency: LatencyModel | None = None,
                 default_ttft_s: float = 2.0, default_tpot_s: float = 0.2, sigma: float = 0.25,
                 admit_probability: float = 0.5, ewma_alpha: float = 0.1, max_prefill_tokens: int = 4096,
                 tie_probability: float = 0.02, affinity_entries: int = 16384, record_refused: bool = False,
                 disaggregation: str = "always", speculative_tokens: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        if disaggregation not in ("auto", "always", "never"):
            raise ValueError(f"goodput policy: disaggregation={disaggregation!r} must be auto, always or never")
        self.disaggregation = disaggregation
        self.placements: Counter[str] = Counter()  # "remote:<why>" / "local:<why>" per admitted decision
        # NOTE: (seq, predicted TTFT, measured TTFT, predicted TPOT, measured TPOT, placement) of finished requests,
        # so a benchmark can set the router's predictions next to what happened and where (GET /v1/stats)
        self.predictions: deque[tuple[int, float, float, float | None, float | None, str]] = deque(maxlen=512)
        self._seq = 0
        for name, v, lo, hi in (("sigma", sigma, 1e-3, 5.0), ("admit_probability", admit_probability, 0, 1),
                                ("ewma_alpha", ewma_alpha, 1e-6, 1), ("tie_probability", tie_probability, 0, 1),
                                ("default_ttft_s", default_ttft_s, 1e-6, 1e6),
                                ("default_tpot_s", default_tpot_s, 1e-6, 1e6),
                                ("max_prefill_tokens", max_prefill_tokens, 1, 1e9),
                                ("affinity_entries", affinity_entries, 1, 1e9)):
            if not lo <= v <= hi:
                raise ValueError(f"goodput policy: {name}={v!r} must be in [{lo}, {hi:g}]")
        self.latency = latency
        self.decode_latency = decode_latency or latency
        if speculative_tokens < 0:
            raise ValueError(f"goodput policy: speculative_tokens={speculative_tokens!r} must be >= 0")
        # NOTE: a speculating decode engine (k draft tokens per step) is predicted at the acceptance rate it
        # reports (LatencyModel.with_speculation); until it reports one, as a plain engine.
        self.spec_k = speculative_tokens
        self._spec_lat: dict[float, LatencyModel] = {}
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
        self.prefix_hit_tokens = 0  # prompt tokens predicted cached on the prefill worker chosen (admitted)
        self._avg_out = 128.0
        # NOTE: ticket -> [routed at, predicted start and end of its prefill step, transfer]; per prefill worker
        # its routes' (ticket, prompt tokens computed) in routing order, for _revise
        self._tickets: OrderedDict[int, list[float]] = OrderedDict()
        self._first: OrderedDict[int, tuple[RouteDecision, float | None]] = OrderedDict()  # TTFT seen, by id()
        self._batches: dict[str, deque[tuple[int, int]]] = {}
        self._next_ticket = 0

    @classmethod
    def from_config(cls, *, router_cfg: RouterConfig | None = None, slo: SLOConfig | None = None,
                    latency: LatencyModel | None = None, prefill_tp: int | None = None,
                    decode_tp: int | None = None, **kwargs: Any) -> GoodputPolicy:
        """Build from the deploy config's `router` and `slo` sections (what `make_policy` calls);
        `prefill_tp`/`decode_tp` size a catalog latency model per pool."""
        if router_cfg is not None:
            kwargs.setdefault("sigma", router_cfg.prediction_sigma)
            kwargs.setdefault("admit_probability", router_cfg.admit_probability)
            kwargs.setdefault("ewma_alpha", router_cfg.ewma_alpha)
            kwargs.setdefault("record_refused", router_cfg.admission == "best_effort")
            kwargs.setdefault("disaggregation", router_cfg.disaggregation)
        if kwargs.get("max_prefill_tokens", 0) is None:  # NOTE: engine.max_num_batched_tokens unset
            del kwargs["max_prefill_tokens"]
        if slo is not None:
            kwargs.setdefault("default_ttft_s", slo.ttft_ms / 1000.0)
            kwargs.setdefault("default_tpot_s", slo.tpot_ms / 1000.0)
        lat = latency or latency_from_config(router_cfg, prefill_tp)
        if decode_tp is not None and router_cfg is not None and router_cfg.latency_model is not None:
            kwargs.setdefault("decode_latency", latency_from_config(router_cfg, decode_tp))
        logger.info("goodput router: prefill %r, decode %r", lat, kwargs.get("decode_latency", lat))
        return cls(lat, **kwargs)

    def calibrate(self, coeffs: Coefficients) -> None:
        """Swap in a latency model fitted on the serving machine (cluster/control/calibration.py). The online
        corrections were learnt against the old model: they start again from 1."""
        self.latency = self.latency.refitted(coeffs, "calibrated")
        self.decode_latency = self.decode_latency.refitted(coeffs, "calibrated")
        self._spec_lat.clear()
        for st in self.states.values():
            st.ttft_ratio = st.tpot_ratio = st.tpot_b = 1.0
            st.set_dr()
            st.pstats = st.dstats = None  # NOTE: their cached prediction terms came from the old model
        logger.info("goodput router: latency model calibrated on this machine: %s", coeffs)

    def decode_model(self, s: WorkerStats) -> LatencyModel:
        """The decode latency model of worker `s`: with speculation at its measured acceptance rate (to 0.01)
        when the decode pool speculates and the engine has reported one."""
        if not self.spec_k or s.spec_acceptance is None:
            return self.decode_latency
        a = round(s.spec_acceptance, 2)
        lat = self._spec_lat.get(a)
        if lat is None:
            lat = self._spec_lat[a] = self.decode_latency.with_speculation(self.spec_k, a)
        return lat

    def describe(self) -> dict[str, Any]:
        return {"policy": "goodput", "latency_model": self.latency.label, "disaggregation": self.disaggregation,
                "speculative_tokens": self.spec_k,
                "placements": dict(self.placements), "prefix_hit_tokens": self.prefix_hit_tokens,
                "predictions": list(self.predictions),
                "corrections": {w: {"ttft": round(s.ttft_ratio, 3), "tpot": round(s.tpot_correction(s.b0 + 1), 3),
                                    "tpot_full": round(s.tpot_ratio, 3),
                                    "tpot_batch": round(s.tpot_b, 2)} for w, s in self.states.items()}}

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

    def _prefill_scan(self, prompt: int, workers: Sequence[WorkerStats], now: float, aff: str | None,
                      nodes: bool, hit: int = 0) -> tuple[list[float], int, list[int], int, dict[str, int]]:
        """Predicted queue wait + own prefill per worker (s); the lowest among workers where we would
        delay none of our queued requests (-1: none), the others ("held"), the affinity worker's index
        and {node: index of its lowest}. On the affinity worker `hit` prompt tokens are in its prefix
        cache: only the rest is computed (their attention still covers the whole prompt)."""
        t = self.latency.terms
        p_mem, p_fixed, dflt = t.p_mem, t.p_fixed, self.max_prefill_tokens
        (fl, tail), (fl_hit, tail_hit), pm1 = _own(t, prompt, 0), _own(t, prompt, hit), prompt - 1
        cut, get = now - self.stale_s, self.states.get
        costs: list[float] = []
        best, best_c, held, aff_i, by_node = -1, _INF, [], -1, {}
        for i, s in enumerate(workers):
            st = get(s.worker_id) or self._state(s.worker_id)
            if st.pstats is not s:
                st.refresh_prefill(s, t, cut)
            mine = hit and s.worker_id == aff
            lin = st.base + (fl_hit if mine else fl)
            c = ((lin if lin > p_mem else p_mem) + st.extra + (tail_hit if mine else tail)) * st.ttft_ratio
            maxb = s.step_tokens or dflt  # NOTE: the engine's own budget wins over the configured fallback
            if st.q > maxb - prompt:
                c += p_fixed * ((st.q + pm1) // maxb) * st.ttft_ratio
            costs.append(c)
            if st.dls:
                held.append(i)
            elif c < best_c:
                best, best_c = i, c
            if s.worker_id == aff:
                aff_i = i
            if nodes and s.node_id:
                k = by_node.get(s.node_id)
                if k is None or c < costs[k]:
                    by_node[s.node_id] = i
        return costs, best, held, aff_i, by_node

    def route(self, req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]
              ) -> RouteDecision:
        prompt, out, slo = req.prompt_tokens, req.max_tokens, req.ttft_slo_s
        if prompt < 0 or out < 1:
            raise ValueError(f"route request needs prompt_tokens >= 0 and max_tokens >= 1, got {prompt} "
                             f"and {out}")
        if not decode:
            return RouteDecision(False, None, None, "no decode workers")
        now, p_meet = self.clock(), self.p_meet
        colocated = not prefill
        pool = decode if colocated else prefill
        aff, hit = self._affine(req) if not colocated else (None, 0)
        if hit and not any(s.worker_id == aff and s.prefix_caching for s in pool):
            hit = 0  # NOTE: that engine keeps no prefix cache (or has left): affinity without a predicted hit
        x_cross = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, False)
        x_same = 0.0 if colocated else self.latency.kv_transfer_time_s(prompt, True)
        # NOTE: the transfer delays the first token only where the decode engine samples it; else the second
        # (the prefill's first token streams at once), so it counts in TPOT: a share of it per output token
        in_ttft = 0.0 if req.first_from_prefill or out <= 1 else 1.0
        costs, nh, held, aff_i, by_node = self._prefill_scan(prompt, pool, now, aff, x_same != x_cross, hit)
        t = self.latency.terms
        own, own_hit = sum(_own(t, prompt, 0)), sum(_own(t, prompt, hit))  # what we add to the batch we join
        harms: dict[int, float] = {}

        def harm(i: int) -> float:
            """The chances our queued requests on prefill worker i lose if we join them (summed)."""
            h = harms.get(i)
            if h is None:
                st = self.states[pool[i].worker_id]
                add = own_hit if i == aff_i else own
                h, c, c0, sat = 0.0, costs[i], costs[i] - add * st.ttft_ratio, costs[i] * self._sat
                for dl in st.dls:  # NOTE: sorted, so once one is sure to make it, so are the later ones
                    if dl - now >= sat:
                        break
                    h += p_meet(dl - now, c0) - p_meet(dl - now, c)
                harms[i] = h
            return h

        best_p, best_v = nh, (p_meet(slo, costs[nh] + x_cross * in_ttft) if nh >= 0 else -_INF)
        if nh >= 0:  # NOTE: value <= P(own TTFT), which falls with the cost: only faster ones can win
            held = [i for i in held if costs[i] < costs[nh]]
        held.sort(key=costs.__getitem__)
        for i in held:
            pt = p_meet(slo, costs[i] + x_cross * in_ttft)
            if pt < best_v:
                break
            if pt - harm(i) > best_v or (pt - harm(i) == best_v and costs[i] < costs[best_p]):
                best_p, best_v = i, pt - harm(i)
        # Decode: the lowest TPOT per node (per worker when colocated or guarding the batch there).
        lat, get, cut, model = self.decode_latency, self.states.get, now - self.stale_s, self.decode_model
        need, ctx_new, avg, inv_om1 = prompt + out, prompt + out // 2, self._avg_out, 1.0 / max(out - 1, 1)
        tp_share = inv_om1 if not in_ttft and out > 1 else 0.0  # NOTE: the transfer's share of each token
        guard = self.default_tpot_s < req.tpot_slo_s and out > 1  # the batch there has a tighter target
        groups: dict[object, tuple[float, int, float]] = {}
        per_worker = colocated or guard
        for j, s in enumerate(decode):
            st = get(s.worker_id) or self._state(s.worker_id)
            if st.dstats is not s:
                st.refresh_decode(s, model(s), self.alpha, cut, avg)
            step = st.step_s(now, ctx_new, lat.terms)
            if colocated and st.pload:  # NOTE: the prompts it prefills take their share of its time
                step /= 1.0 - st.prefill_share(now)
            tpot = st.tpot_s(step, need, inv_om1)
            key = j if per_worker else s.node_id
            g = groups.get(key)
            if g is None or tpot < g[0]:
                groups[key] = (tpot, j, step)
        best = (-_INF, _INF, 0, 0, 0.0, 0.0, 0.0)  # value, TPOT, decode index, prefill index, P(own), transfer, step
        best_admits, admit_p = False, self.admit_probability
        cands = sorted(groups.values()) if len(groups) > 1 else groups.values()
        for tpot, j, step in cands:
            ptp = 1.0 if out <= 1 else p_meet(req.tpot_slo_s, tpot)
            if ptp < best[0] and (best_admits or ptp < admit_p):
                break  # NOTE: value and P(own) <= P(own TPOT), which falls with the TPOT
            d = decode[j]
            if colocated:
                pi, x, pt, h = j, 0.0, p_meet(slo, costs[j]), harm(j)
                # NOTE: our prompt joins a step of the streams decoding there: each of their tokens waits for it
                sj = self.states[d.worker_id]
                h += self._stall_harm(sj.b0, own * sj.ttft_ratio, step)
            else:
                pi, x, h = best_p, x_cross, harm(best_p)
                pt = best_v + h
                ptp_x = p_meet(req.tpot_slo_s, tpot + x_cross * tp_share) if tp_share else ptp
                nb = by_node.get(d.node_id, -1) if by_node and d.node_id else -1
                # NOTE: a same-node prefill (best_p itself, if it is on d's node) can only win if it is faster
                # with its transfer, or best_p harms; ties go to it
                if nb >= 0 and (costs[nb] + x_same < costs[best_p] + x_cross or h > 0):
                    pt_n, h_n = p_meet(slo, costs[nb] + x_same * in_ttft), harm(nb)
                    ptp_n = p_meet(req.tpot_slo_s, tpot + x_same * tp_share) if tp_share else ptp
                    if pt_n * ptp_n - h_n >= pt * ptp_x - h:
                        pi, x, pt, h, ptp_x = nb, x_same, pt_n, h_n, ptp_n
                tpot, ptp = tpot + x * tp_share, ptp_x
            p_own = pt * ptp
            value = p_own - h
            st = self.states[d.worker_id]
            if guard and st.b0:
                ratio = lat.decode_step_time_s(st.b0, st.c0) / lat.decode_step_time_s(st.b0 + 1,
                                                                                      st.c0 + ctx_new)
                value -= st.b0 * (p_meet(self.default_tpot_s, step * ratio) - p_meet(self.default_tpot_s, step))
            admits = p_own >= admit_p and value > 0
            # NOTE: a pair that would be admitted beats one that would be refused, whatever their values
            if admits != best_admits:
                better = admits
            else:
                better = value > best[0] or (value == best[0] and tpot < best[1])
            if better:
                best, best_admits = (value, tpot, j, pi, p_own, x, step), admits
        value, tpot, j, pi, p_own, x, step = best
        d = decode[j]
        if aff_i >= 0 and aff_i != pi:
            xa = x_same if d.node_id and prefill[aff_i].node_id == d.node_id else x_cross
            pt, pt_a = p_meet(slo, costs[pi] + x * in_ttft), p_meet(slo, costs[aff_i] + xa * in_ttft)
            if pt > 0 and pt_a - harm(aff_i) >= pt - harm(pi) - self.tie_probability:
                p_own, value = p_own / pt * pt_a, value + (pt_a - harm(aff_i)) - (pt - harm(pi))
                pi, x, tpot = aff_i, xa, tpot + (xa - x) * tp_share
        ttft_s, ds = costs[pi] + x * in_ttft, self.states[d.worker_id]
        tb = ds.b0 + 1  # NOTE: the batch the TPOT correction was taken at (before we are booked into it)
        admit = p_own >= admit_p and value > 0
        declined = None  # NOTE: why not a local prefill (auto), in the refusal's reason
        if not colocated and self.disaggregation != "always":
            l_tpot = tpot - x * tp_share  # NOTE: no transfer there
            local = self._local(req, d, step, l_tpot, value, admit)
            if isinstance(local, Declined):
                declined = local
            else:
                l_ttft, l_own, l_value, why = local
                l_admit = l_own >= self.admit_probability and l_value > 0
                if l_admit or self.record_refused:
                    self._record_local(req, ds, now, l_ttft)
                if l_admit:
                    self.placements[f"local:{why}"] += 1
                reason = f"goodput: local prefill ({why})" if l_admit else (
                    f"no worker meets the targets with a local prefill: P(slo)={l_own:.3f} (net of others "
                    f"{l_value:.3f}), TTFT {l_ttft:.3f} s vs {req.ttft_slo_s:.3f} s, TPOT {l_tpot:.3f} s")
                return RouteDecision(l_admit, None, d.worker_id, reason, l_ttft, l_tpot if out > 1 else None, l_own,
                                     local=True, placement=f"local:{why}",
                                     corrections=Corrections(ds.step_ratio, ds.ttft_ratio, ds.tpot_correction(tb), tb))
        p_id = None if colocated else prefill[pi].worker_id
        ticket = 0
        if admit or self.record_refused:
            n_hit, ps = hit if pi == aff_i else 0, self.states[pool[pi].worker_id]
            maxb = pool[pi].step_tokens or self.max_prefill_tokens
            # NOTE: behind a queue (another ingress's too) our step starts once its own compute is all that is left
            wait = costs[pi] - (own_hit if n_hit else own) * ps.ttft_ratio if ps.q or ps.run else 0.0
            ticket = self._revise(pool[pi].worker_id, maxb, now, costs[pi], x * in_ttft, prompt - n_hit, wait)
            self._record(req, ps, ds, p_id, now, costs[pi], x, x * in_ttft, n_hit)
        if admit and pi == aff_i and hit:
            self.prefix_hit_tokens += hit
        placement = "" if colocated else "remote:" + ("always" if self.disaggregation == "always" else "cheaper")
        if admit and placement:
            self.placements[placement] += 1
        reason = "goodput" if admit else (
            f"no pair meets the targets: best P(slo)={p_own:.3f} (net of others {value:.3f}), TTFT "
            f"{ttft_s:.3f} s vs {req.ttft_slo_s:.3f} s, TPOT {tpot:.3f} s vs {req.tpot_slo_s:.3f} s"
            + ("" if declined is None else f"; local prefill on {d.worker_id}: {declined}"))
        return RouteDecision(admit, p_id, d.worker_id, reason, ttft_s, tpot if out > 1 else None, p_own,
                             placement=placement,
                             corrections=Corrections(ds.step_ratio, self.states[pool[pi].worker_id].ttft_ratio,
                                                     ds.tpot_correction(tb), tb, ticket))

    def _revise(self, wid: str, maxb: int, now: float, cost: float, transfer: float, tokens: int,
                wait: float) -> int:
        """Book a route to prefill worker `wid` (`tokens` to compute, its prefill predicted to end `cost` s from
        now, to start `wait` s from now where none of ours is ahead) and return its ticket. Routes there still
        waiting for their step (predicted to start after now) that fit in one step with it (`maxb` tokens, newest
        first) are prefilled in its step: their predicted prefill end becomes its own. Its step starts when
        they were to start, else when the step before ends."""
        tickets, end = self._tickets, now + cost
        batch = self._batches.get(wid)
        if batch is None:
            batch = self._batches[wid] = deque()
        while batch and batch[0][0] not in tickets:  # NOTE: observed, or dropped as too old
            batch.popleft()
        acc, start = tokens, now + max(0.0, wait)
        for tk, n in reversed(batch):
            e = tickets.get(tk)
            if e is None:
                continue
            if e[1] <= now:  # NOTE: its step has started: ours comes after it
                start = max(now, e[2])
                break
            if acc + n > maxb:  # NOTE: a full step waiting before ours
                start = e[2]
                break
            acc += n
            start = e[1]
            if e[2] < end:
                e[2] = end
        self._next_ticket += 1
        batch.append((self._next_ticket, tokens))
        tickets[self._next_ticket] = [now, min(start, end), end, transfer]
        while len(tickets) > TICKETS:
            tickets.popitem(last=False)
        return self._next_ticket

    def _affine(self, req: RouteRequest) -> tuple[str | None, int]:
        """The prefill worker that last took a prompt sharing this one's longest tracked prefix, and that
        prefix's length (0 when only `prefix_hash` is known: affinity without a predicted hit)."""
        for n, h in reversed(req.prefixes):
            w = self._affinity.get(h)
            if w is not None:
                return w, n
        return (self._affinity.get(req.prefix_hash) if req.prefix_hash else None), 0

    def _record(self, req: RouteRequest, ps: WorkerState, ds: WorkerState, p_id: str | None, now: float,
                prefill_s: float, transfer: float, transfer_in_ttft: float, hit: int = 0) -> None:
        """Book an admitted route: its prefill (done `prefill_s` from now) on `ps`, its KV (`transfer` s later)
        and decoding on `ds`; `transfer_in_ttft`: the part of the transfer its first token waits for."""
        ps.add_prefill(self.latency.terms, now, req.prompt_tokens - hit, now + req.ttft_slo_s - transfer_in_ttft)
        self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
        ds.add_decode_load(now, req.max_tokens)
        if p_id is None:  # NOTE: colocated: the prompt runs beside the worker's own streams
            ps.add_prefill_load(now, sum(_own(self.latency.terms, req.prompt_tokens, hit)))
            return
        if req.max_tokens > 1:
            need, ctx = req.prompt_tokens + req.max_tokens, req.prompt_tokens + req.max_tokens // 2
            ds.add_decode(self.decode_latency.terms, now + prefill_s + transfer, need, ctx, self._avg_out)
        keys = [h for _, h in req.prefixes] or ([req.prefix_hash] if req.prefix_hash else [])
        for h in keys:
            self._affinity[h] = p_id
            self._affinity.move_to_end(h)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)

    def observe_first_token(self, decision: RouteDecision, route: RouteRequest, ttft_s: float) -> None:
        """The TTFT correction learns at the first token, not at the end of the stream: the next burst is
        routed with what the last one measured."""
        self._first[id(decision)] = (decision, self._observe_ttft(decision, ttft_s))
        while len(self._first) > TICKETS:  # NOTE: a request that never finishes is dropped, oldest first
            self._first.popitem(last=False)

    def _observe_ttft(self, decision: RouteDecision, ttft_s: float) -> float | None:
        """The TTFT predicted for this decision (as revised by later routes into its prefill step), after
        moving the serving worker's TTFT correction toward measured/predicted."""
        pred, wid = decision.predicted_ttft_s, decision.prefill or decision.decode
        c = decision.corrections or Corrections()
        e = self._tickets.pop(c.ticket, None) if c.ticket else None
        if e is not None:
            pred = e[2] - e[0] + e[3]
        if wid and pred and math.isfinite(pred) and ttft_s > 0:
            st = self._state(wid)
            st.ttft_ratio = _learn(st.ttft_ratio, c.ttft_ratio, ttft_s / pred, self.alpha)
        return pred

    def observe(self, decision: RouteDecision, route: RouteRequest, ttft_s: float,
                tpot_s: float | None) -> None:
        """Feedback after a request: move the serving workers' correction ratios toward observed/predicted
        (the TTFT one here only if `observe_first_token` did not)."""
        first = self._first.pop(id(decision), None)
        # NOTE: the decision itself is kept with its prediction, so a recycled id() cannot match another's
        pred = first[1] if first is not None and first[0] is decision else self._observe_ttft(decision, ttft_s)
        if pred is not None and math.isfinite(pred):
            self._seq += 1
            p_tpot = decision.predicted_tpot_s
            self.predictions.append((self._seq, round(pred, 4), round(ttft_s, 4),
                                     None if p_tpot is None or not math.isfinite(p_tpot) else round(p_tpot, 5),
                                     None if tpot_s is None else round(tpot_s, 5), decision.placement or "colocated"))
        pred = decision.predicted_tpot_s
        c = decision.corrections or Corrections()
        if decision.decode and pred and math.isfinite(pred) and tpot_s:
            st = self._state(decision.decode)
            if c.step_ratio:
                # NOTE: the step-time correction learnt from this very request's steps since it was routed is
                # not the TPOT correction's to learn again (their product would count the slowdown twice):
                # compare with the prediction the current step correction makes.
                pred *= st.step_ratio / c.step_ratio
            st.tpot_ratio = _learn(st.tpot_ratio, c.tpot_ratio, tpot_s / pred, self.alpha)
            # NOTE: and the batch it was learnt at (WorkerState.tpot_correction): the one this request joined
            st.tpot_b += self.alpha * ((c.tpot_batch or 1) - st.tpot_b)
            st.set_dr()


register("goodput")(GoodputPolicy.from_config)
