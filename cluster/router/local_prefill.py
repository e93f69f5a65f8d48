"""The goodput policy's local-prefill option in a disaggregated deployment (`router.disaggregation` auto or
never): the prompt is prefilled on the decode worker itself. No KV transfer and no prefill queue, but its
prefill joins a step of the streams decoding there and stalls them; that cost (`_stall_harm`) is the same
term a prompt routed to a colocated worker pays. docs/router.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from cluster.router.policy import RouteRequest
from engine.contract import WorkerStats

if TYPE_CHECKING:
    from cluster.router.goodput_state import WorkerState
    from placement.latency import LatencyModel

LOCAL_PER_SNAPSHOT = 2  # local prefills per decode worker between two of its stats snapshots (auto)


class Declined(NamedTuple):
    """Why `auto` did not prefill locally; formatted only into a refusal's reason (routing is a hot path)."""

    own: float = 0.0  # P(own targets) with a local prefill
    value: float = 0.0  # net of what it costs the streams there
    streams: int = 0
    ttft: float = 0.0
    burst: bool = False  # LOCAL_PER_SNAPSHOT local prefills already routed since the worker's last stats

    def __str__(self) -> str:
        if self.burst:
            return f"{LOCAL_PER_SNAPSHOT} local prefills routed since its last stats"
        return f"P(slo)={self.own:.3f} (net of the {self.streams} streams there {self.value:.3f}), TTFT {self.ttft:.3f} s"


class LocalPrefill:
    """Mixin of GoodputPolicy (it owns the state these methods read)."""

    states: dict[str, WorkerState]
    decode_latency: LatencyModel
    disaggregation: str
    tie_probability: float
    admit_probability: float
    default_tpot_s: float
    stale_s: float
    _avg_out: float
    clock: Callable[[], float]
    p_meet: Callable[[float, float], float]

    def _local(self, req: RouteRequest, d: WorkerStats, step: float, tpot: float, remote_value: float,
               remote_admits: bool = True) -> tuple[float, float, float, str] | Declined:
        """The local-prefill option on decode worker `d`: (TTFT, P(own targets), value net of what it costs the
        streams decoding there, why), or why not when remote prefill is better or local is ruled out (`auto`).
        `remote_admits`: whether the remote option would be admitted; one that would be refused is worth nothing,
        so a local option that would be admitted wins whatever the remote one's value.

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
            # NOTE: a burst within one stats interval does not all land on one decode engine
            return Declined(burst=True)
        lin = st.base + t.pa * prompt + t.pb * prompt * prompt
        pre = (lin if lin > t.p_mem else t.p_mem) + st.extra + t.p_lin * prompt
        ttft = (pre + (step if streams else 0.0)) * st.ttft_ratio
        p_meet = self.p_meet
        ptp = 1.0 if out <= 1 else p_meet(req.tpot_slo_s, tpot)
        own = p_meet(req.ttft_slo_s, ttft) * ptp
        value = own - self._stall_harm(streams, pre * st.dr, step)
        if self.disaggregation == "never":
            return ttft, own, value, "never"
        admits = own >= self.admit_probability and value > 0
        # NOTE: an option that is admitted beats one that is refused (a refused request is worth 0, an admitted
        # one its value > 0): comparing values alone, a local option likely to meet the SLO could lose to a
        # remote one of slightly higher value that admission then refuses, and the request was refused. Between
        # two of the same kind, the higher value; ties go local (no transfer, a prefill worker left free for the
        # next long prompt).
        if admits != remote_admits:
            take = admits
        else:
            take = value >= remote_value - self.tie_probability
        if take:
            return ttft, own, value, "idle decode" if not streams else "cheaper"
        return Declined(own, value, streams, ttft)

    def _stall_harm(self, streams: int, stall_s: float, step: float) -> float:
        """What `streams` decoding at `step` s per token lose in P(TPOT target) when a prefill of `stall_s` joins
        one of their steps: that step lasts it longer, spread over their remaining tokens (~half the average
        output).

        NOTE: a request's TPOT, (end - first token) / (output - 1), grows by stall / (output - 1) wherever the
        stall falls, half of what this counts. The margin stays: `step` (the streams' predicted TPOT) does not
        hold the stalls of the other prompts prefilled beside them during their life, and the step correction
        learns from the median step, which leaves those stalls out. With the marginal cost alone, a burst was
        prefilled locally prompt after prompt and the streams beside it ran at about three times their predicted
        TPOT (the evidence is in docs/router.md)."""
        if not streams:
            return 0.0
        stretch = stall_s / max(1.0, self._avg_out / 2)
        return streams * (self.p_meet(self.default_tpot_s, step) - self.p_meet(self.default_tpot_s, step + stretch))

    def _record_local(self, req: RouteRequest, ds: WorkerState, now: float, ttft: float) -> None:
        ds.add_prefill(self.decode_latency.terms, now, req.prompt_tokens, now + req.ttft_slo_s)
        ds.add_decode_load(now, req.max_tokens)
        self._avg_out += 0.05 * (req.max_tokens - self._avg_out)
        if req.max_tokens > 1:
            need, ctx = req.prompt_tokens + req.max_tokens, req.prompt_tokens + req.max_tokens // 2
            ds.add_decode(self.decode_latency.terms, now + ttft, need, ctx, self._avg_out)
