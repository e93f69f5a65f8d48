"""The goodput policy's one-engine options in a disaggregated deployment (`router.disaggregation`): instead
of prefill worker -> KV -> decode worker, one engine runs the whole request.

    local:  the prompt is prefilled on the decode worker itself (`auto`, `never`): no KV transfer and no
            prefill queue, but its prefill joins a step of the streams decoding there and stalls them.
    whole:  prefill and decode both on a prefill worker (`auto`): its spare time decodes when the decode pool
            is the bottleneck. The stream's steps share the engine with the prompts routed there (their
            share of its time over the last 10 s, as on a colocated worker), and every prompt routed there
            later stalls it, a cost those routes pay (`_streams_harm`, part of the policy's `harm`).

Each option is predicted like the disaggregated pair (TTFT, TPOT, P(meet), the harm to others) and wins only
when its value is higher; ties go local over remote (no transfer) and remote over whole (a prefill worker
kept for prompts). docs/router.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cluster.router.policy import RouteDecision, RouteRequest
from engine.stats import WorkerStats

if TYPE_CHECKING:
    from cluster.router.goodput_state import WorkerState
    from placement.latency import LatencyModel

LOCAL_PER_SNAPSHOT = 2  # one-engine routes per worker between two of its stats snapshots (auto)


class OneEngineOptions:
    """Mixin of GoodputPolicy (it owns the state these methods read)."""

    states: dict[str, WorkerState]
    latency: LatencyModel
    decode_latency: LatencyModel
    disaggregation: str
    tie_probability: float
    admit_probability: float
    default_tpot_s: float
    record_refused: bool
    max_prefill_tokens: int
    alpha: float
    stale_s: float
    _avg_out: float
    clock: Callable[[], float]
    p_meet: Callable[[float, float], float]
    _revise: Callable[..., int]
    _remember: Callable[[RouteRequest, str], None]
    placements: dict[str, int]

    def _local(self, req: RouteRequest, d: WorkerStats, step: float, tpot: float, remote_value: float
               ) -> tuple[float, float, float, str] | None:
        """The local-prefill option on decode worker `d`: (TTFT, P(own targets), value net of what it costs the
        streams decoding there, why), or None when remote prefill is better (`auto`).

        A prefill on a decode engine joins one of its steps: that step lasts the prefill longer for every
        stream running there, spread over their remaining tokens (~half the average output). The KV transfer
        and the prefill pool's queue are saved."""
        prompt, out, t = req.prompt_tokens, req.max_tokens, self.decode_latency.terms
        st = self.states[d.worker_id]
        if st.pstats is not d:  # NOTE: the prefill queue there, our own local routes since its stats included
            st.refresh_prefill(d, t, self.clock() - self.stale_s)
        # NOTE: the streams a local prefill would stall: the worker's batch plus what we routed there since
        # its stats (st.b0: running + waiting + ours on the way), not the snapshot's `running` alone.
        streams = st.b0 if st.dstats is d else d.running
        if self.disaggregation == "auto" and sum(e[0] > d.timestamp_s for e in st.led) >= LOCAL_PER_SNAPSHOT:
            return None  # NOTE: a burst within one stats interval does not all land on one decode engine
        lin = st.base + t.pa * prompt + t.pb * prompt * prompt
        pre = (lin if lin > t.p_mem else t.p_mem) + st.extra + t.p_lin * prompt
        ttft = (pre + (step if streams else 0.0)) * st.ttft_ratio
        p_meet = self.p_meet
        ptp = 1.0 if out <= 1 else p_meet(req.tpot_slo_s, tpot)
        own = p_meet(req.ttft_slo_s, ttft) * ptp
        value = own - self._stall_harm(streams, pre * st.dr, step)
        if self.disaggregation == "never":
            return ttft, own, value, "never"
        # NOTE: ties go local (no transfer, a prefill worker left free for the next long prompt).
        if value >= remote_value - self.tie_probability:
            return ttft, own, value, "idle decode" if not streams else "cheaper"
        return None

    def _stall_harm(self, streams: int, stall_s: float, step: float) -> float:
        """What `streams` decoding at `step` s per token lose in P(TPOT target) when a prefill of `stall_s` joins
        one of their steps: that step lasts it longer, spread over their remaining tokens (~half the average
        output)."""
        if not streams:
            return 0.0
        stretch = stall_s / max(1.0, self._avg_out / 2)
        return streams * (self.p_meet(self.default_tpot_s, step) - self.p_meet(self.default_tpot_s, step + stretch))

    def _streams_step(self, st: WorkerState, s: WorkerStats, now: float, ctx_new: int) -> float:
        """A decode step of the whole requests on prefill worker `s` (with one of `ctx_new` context tokens more),
        stretched by the share of its time the prompts routed there take."""
        st.refresh_streams(s, self.latency, self.alpha, now - self.stale_s, self._avg_out)
        return st.step_s(now, ctx_new, self.latency.terms) / (1.0 - st.prefill_share(now))

    def _streams_harm(self, s: WorkerStats, stall_s: float, now: float) -> float:
        """What a prompt of `stall_s` routed to prefill worker `s` costs the whole requests decoding there."""
        if not s.decoding:
            return 0.0
        st = self.states[s.worker_id]
        step = self._streams_step(st, s, now, 0)
        return self._stall_harm(st.b0, stall_s, step)

    def _whole(self, req: RouteRequest, prefill: Sequence[WorkerStats], costs: Sequence[float],
               harm: Callable[[int], float], now: float, beat: float) -> tuple[int, float, float, float] | None:
        """The best whole-request option on a prefill worker: (index, TPOT, P(own targets), value net of the
        harm to others), or None unless its value beats `beat` (the chosen two-engine or local option's) by
        more than the tie margin."""
        prompt, out, p_meet, margin = req.prompt_tokens, req.max_tokens, self.p_meet, self.tie_probability
        if out <= 1:
            return None  # NOTE: a one-token request runs on its prefill worker anyway
        need, ctx_new, inv_om1 = prompt + out, prompt + out // 2, 1.0 / (out - 1)
        best = None
        for i, s in enumerate(prefill):
            pt = p_meet(req.ttft_slo_s, costs[i])
            if pt - margin <= beat or not s.healthy:  # NOTE: value <= P(own TTFT)
                continue
            st = self.states[s.worker_id]
            step = self._streams_step(st, s, now, ctx_new)
            if sum(e[0] > s.timestamp_s for e in st.dload) >= LOCAL_PER_SNAPSHOT:
                continue  # NOTE: a burst within one stats interval does not all land on one prefill engine
            tpot = st.tpot_s(step, need, inv_om1)
            p_own = pt * p_meet(req.tpot_slo_s, tpot)
            value = p_own - harm(i)
            if value - margin > beat and (best is None or value > best[3]):
                best = (i, tpot, p_own, value)
        return best

    def _route_whole(self, req: RouteRequest, s: WorkerStats, cost: float, tpot: float, p_own: float, value: float,
                     now: float, hit: int, own: float) -> RouteDecision:
        """Book (when admitted, or best-effort) and return the whole-request decision on prefill worker `s`:
        `decode` names it, `local` says one engine runs it all."""
        st, wid, prompt = self.states[s.worker_id], s.worker_id, req.prompt_tokens
        admit = p_own >= self.admit_probability and value > 0
        ticket = 0
        if admit or self.record_refused:
            wait = cost - own * st.ttft_ratio if st.q or st.run else 0.0
            ticket = self._revise(wid, s.step_tokens or self.max_prefill_tokens, now, cost, 0.0, prompt - hit, wait)
            st.add_prefill(self.latency.terms, now, prompt - hit, now + req.ttft_slo_s)
            st.add_prefill_load(now, own)
            st.add_decode_load(now, req.max_tokens)
            self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
            need, ctx = prompt + req.max_tokens, prompt + req.max_tokens // 2
            st.add_decode(self.latency.terms, now + cost, need, ctx, self._avg_out)
            self._remember(req, wid)
        if admit:
            self.placements["whole:cheaper"] += 1
        reason = "goodput: whole request on a prefill worker" if admit else (
            f"no worker meets the targets: best P(slo)={p_own:.3f} (net of others {value:.3f}) for the whole "
            f"request on {wid}, TTFT {cost:.3f} s vs {req.ttft_slo_s:.3f} s, TPOT {tpot:.3f} s")
        return RouteDecision(admit, None, wid, reason, cost, tpot, p_own, local=True, placement="whole:cheaper",
                             step_ratio=st.step_ratio, ticket=ticket, ttft_ratio=st.ttft_ratio,
                             tpot_ratio=st.tpot_ratio)

    def _record_local(self, req: RouteRequest, ds: WorkerState, now: float, ttft: float) -> None:
        ds.add_prefill(self.decode_latency.terms, now, req.prompt_tokens, now + req.ttft_slo_s)
        ds.add_decode_load(now, req.max_tokens)
        self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
        if req.max_tokens > 1:
            need, ctx = req.prompt_tokens + req.max_tokens, req.prompt_tokens + req.max_tokens // 2
            ds.add_decode(self.decode_latency.terms, now + ttft, need, ctx, self._avg_out)
