"""router.disaggregation (cluster/router/goodput.py): per request, prefill on a prefill worker (KV moved to
the decode worker) or on the decode worker itself, from the predicted TTFT/TPOT of each option, the
transfer, and the stall a local prefill causes the streams decoding there."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.config import DeployConfig, RouterConfig, SLOConfig
from cluster.router import RouteRequest, make_policy
from cluster.router.admission import Admission
from cluster.serve.membership import Membership
from engine.contract import WorkerStats


def policy(mode: str):
    return make_policy("goodput", router_cfg=RouterConfig(disaggregation=mode), slo=SLOConfig(ttft_ms=2000,
                                                                                                   tpot_ms=150))


def prefill(queued: int = 0) -> list[WorkerStats]:
    return [WorkerStats("p0", "prefill", "n1", queued // 250, 0, queued, 0, 0.0, 5760, (), True, time.time())]


def decode(running: int = 0, ctx_each: int = 300) -> list[WorkerStats]:
    return [WorkerStats("d0", "decode", "n1", 0, running, 0, running * ctx_each, running * ctx_each / 5760, 5760,
                        (), True, time.time())]


def test_the_default_is_auto() -> None:
    assert RouterConfig().disaggregation == "auto"
    assert make_policy("goodput", router_cfg=RouterConfig(), slo=SLOConfig()).disaggregation == "auto"
    with pytest.raises(ValueError, match="disaggregation"):
        make_policy("goodput", router_cfg=None, slo=SLOConfig(), disaggregation="sometimes")


def test_auto_prefills_a_short_prompt_on_an_idle_decode_worker() -> None:
    p = policy("auto")
    d = p(RouteRequest(40, 32, 2.0, 0.15), prefill(), decode())
    assert d.admit and d.local and d.prefill is None and d.decode == "d0" and d.placement == "local:idle decode"
    assert p.describe()["placements"] == {"local:idle decode": 1}


def test_auto_sends_a_long_prompt_to_the_prefill_pool_when_streams_are_decoding() -> None:
    p = policy("auto")
    d = p(RouteRequest(900, 32, 2.0, 0.15), prefill(), decode(running=12))
    assert d.admit and not d.local and d.prefill == "p0" and d.placement == "remote:cheaper", d


def test_auto_prefills_locally_when_the_prefill_queue_would_miss_the_ttft() -> None:
    p = policy("auto")
    req = RouteRequest(300, 32, 2.0, 0.15)
    remote = policy("always")(req, prefill(queued=6000), decode(running=2))
    local = p(req, prefill(queued=6000), decode(running=2))
    assert not remote.admit and remote.predicted_ttft_s > 2.0
    assert local.admit and local.local and local.predicted_ttft_s < 2.0


def test_always_and_never() -> None:
    req = RouteRequest(40, 32, 2.0, 0.15)
    a = policy("always")(req, prefill(), decode())
    n = policy("never")(req, prefill(), decode(running=12))
    assert not a.local and a.prefill == "p0" and a.placement == "remote:always"
    assert n.local and n.prefill is None and n.placement == "local:never"


def test_a_burst_of_local_prefills_counts_its_own_queue() -> None:
    """Routes made since the decode worker's last stats are its prefill queue: a burst on one idle decode
    worker does not all go local with the same lone-request TTFT."""
    p = policy("auto")
    ps, ds = prefill(), decode()
    got = [p(RouteRequest(500, 32, 2.0, 0.15), ps, ds) for _ in range(12)]
    local = [d for d in got if d.local]
    assert local and len(local) < len(got)
    ttfts = [d.predicted_ttft_s for d in local]
    assert ttfts == sorted(ttfts) and ttfts[-1] > ttfts[0]


def test_never_with_a_baseline_policy_prefills_on_the_decode_worker() -> None:
    cfg = DeployConfig(router=RouterConfig(policy="least_loaded", disaggregation="never"))
    members = Membership(None, cfg.mode, 0.1, busy=lambda: False)
    members.handles = {"p0": object(), "d0": object()}
    members.roles = {"p0": "prefill", "d0": "decode"}
    members.stats = {"p0": prefill()[0], "d0": decode()[0]}
    adm = Admission(make_policy("least_loaded"), members, cfg.router, colocated=False, recovery_timeout_s=1.0)
    d = asyncio.run(adm.route(RouteRequest(40, 8, 2.0, 0.2)))
    assert d.local and d.prefill is None and d.decode == "d0" and d.placement == "local:never"


def test_a_burst_within_one_stats_interval_sends_at_most_two_local_prefills_per_decode_worker() -> None:
    from cluster.router.local_prefill import LOCAL_PER_SNAPSHOT

    p = policy("auto")
    ps, ds = prefill(), decode()
    got = [p(RouteRequest(40, 32, 2.0, 0.15), ps, ds) for _ in range(10)]
    assert sum(d.local for d in got) == LOCAL_PER_SNAPSHOT == 2
    assert all(d.admit for d in got)


def test_streams_routed_since_the_last_stats_count_as_decoding_there() -> None:
    """The decode worker's snapshot says idle, but we just sent it streams: a local prefill there would
    stall them, so it is not an 'idle decode' placement."""
    p = policy("auto")
    ps = prefill()
    remote = [p(RouteRequest(400, 64, 2.0, 0.15), ps, decode(running=12)) for _ in range(2)]
    assert all(d.admit and not d.local for d in remote)
    idle_snapshot = decode()  # NOTE: newer than the routes, but before their streams reach the engine
    fresh = policy("auto")(RouteRequest(40, 32, 2.0, 0.15), ps, idle_snapshot)
    assert fresh.placement == "local:idle decode"  # what the snapshot alone says
    d = p(RouteRequest(40, 32, 2.0, 0.15), ps, idle_snapshot)
    assert d.placement != "local:idle decode", d


def test_decode_corrections_learnt_under_load_fade_while_the_worker_is_idle() -> None:
    from cluster.router.goodput_state import IDLE_HALF_LIFE_S, WorkerState

    p = policy("auto")
    st = WorkerState()
    st.tpot_ratio, st.step_ratio = 4.0, 1.0
    t0 = time.time()

    def idle(at: float) -> WorkerStats:
        return WorkerStats("d0", "decode", "n1", 0, 0, 0, 0, 0.0, 5760, (), True, at)

    st.refresh_decode(idle(t0), p.decode_latency, p.alpha, t0 - 60, 32)
    assert st.tpot_ratio == 4.0  # NOTE: idle from now on
    st.refresh_decode(idle(t0 + IDLE_HALF_LIFE_S), p.decode_latency, p.alpha, t0 - 60, 32)
    assert st.tpot_ratio == pytest.approx(2.0)
    st.refresh_decode(idle(t0 + 3 * IDLE_HALF_LIFE_S), p.decode_latency, p.alpha, t0 - 60, 32)
    assert st.tpot_ratio == pytest.approx(4.0 ** 0.125) and st.dr == pytest.approx(st.tpot_ratio)
    busy = WorkerStats("d0", "decode", "n1", 0, 3, 0, 900, 0.1, 5760, (), True, t0 + 40)
    st.tpot_ratio = 3.0
    st.refresh_decode(busy, p.decode_latency, p.alpha, t0 - 60, 32)
    st.refresh_decode(busy._replace(timestamp_s=t0 + 80), p.decode_latency, p.alpha, t0 - 60, 32)
    assert st.tpot_ratio == 3.0  # NOTE: busy: what it learnt stays


def test_a_ttft_correction_fades_while_the_prefill_queue_is_empty() -> None:
    """A correction high enough to refuse everything would never be corrected by traffic (refusals teach
    nothing): it fades toward the calibrated model while the worker has nothing to prefill."""
    from cluster.router.goodput_state import PREFILL_IDLE_HALF_LIFE_S, WorkerState

    p = policy("auto")
    st = WorkerState()
    st.ttft_ratio = 4.0
    t0 = time.time()

    def prefill(at: float, waiting: int = 0, queued: int = 0) -> WorkerStats:
        return WorkerStats("p0", "prefill", "n1", waiting, 0, queued, 0, 0.0, 5760, (), True, at)

    st.refresh_prefill(prefill(t0), p.latency.terms, t0 - 60)
    st.refresh_prefill(prefill(t0 + PREFILL_IDLE_HALF_LIFE_S), p.latency.terms, t0 - 60)
    assert st.ttft_ratio == pytest.approx(2.0)
    st.refresh_prefill(prefill(t0 + 70, waiting=2, queued=500), p.latency.terms, t0 - 60)
    st.refresh_prefill(prefill(t0 + 200, waiting=2, queued=500), p.latency.terms, t0 - 60)
    assert st.ttft_ratio == pytest.approx(2.0)  # NOTE: a queue: what it learnt stays


def test_a_refusal_says_why_no_local_prefill_was_taken() -> None:
    """The prefill queue misses the TTFT; the decode worker took two local prefills since its last stats (the
    burst limit), so the third is refused, and its reason says so (a 429 body a user can act on)."""
    p = policy("auto")
    ps, ds = prefill(queued=6000), decode(running=2)
    got = [p(RouteRequest(300, 32, 2.0, 0.15), ps, ds) for _ in range(3)]
    assert [d.local for d in got[:2]] == [True, True] and not got[2].admit
    assert "local prefill on d0: 2 local prefills routed since its last stats" in got[2].reason, got[2].reason
    worse = policy("auto")(RouteRequest(300, 32, 2.0, 0.15), prefill(queued=6000), decode(running=40))
    assert not worse.admit and "local prefill on d0: P(slo)=" in worse.reason, worse.reason


def test_a_stall_costs_the_streams_at_least_what_it_adds_to_the_tpot_they_are_judged_by() -> None:
    """A prefill joining a step delays each stream there by its length once; the TPOT a request is judged by
    (benchmarks.stats.tpot: (end - first token) / (output - 1)) grows by stall / (output - 1). The policy's
    harm is never less than the chance of meeting the target that this loses (it keeps a margin for the
    stalls of other prompts during the streams' life, local_prefill.py says why), and grows with the streams."""
    from benchmarks.client import RequestRecord
    from benchmarks.stats import tpot

    p = policy("auto")
    out, step, stall = 32, 0.135, 0.45
    p._avg_out = float(out)
    rec = RequestRecord(0, 256, out, 0.0, status=200, ttft_s=0.5, e2e_s=0.5 + (out - 1) * step + stall,
                        completion_tokens=out)
    lost = p.p_meet(0.15, step) - p.p_meet(0.15, tpot(rec))
    assert lost > 0.05  # NOTE: near the target a stall costs a stream a real chance
    one = p._stall_harm(1, stall, step)
    assert lost <= one <= 3 * lost
    assert p._stall_harm(7, stall, step) == pytest.approx(7 * one, rel=1e-6)
    assert p._stall_harm(0, stall, step) == 0.0


def test_a_local_option_that_would_be_admitted_beats_a_remote_one_that_would_be_refused() -> None:
    """A refused request is worth nothing: a local prefill at P(slo) 0.72, net of what it costs the 3 streams
    there, wins over a remote pair at P(slo) 0.32 even where the remote pair's value (0.32, it harms nobody) is
    higher. (Found in the mixed-trace run of 2026-12-05 at 1.5 req/s: local at P(slo) 0.95 and value +0.23
    declined for a remote pair at P(slo) 0.31, and the request refused.)"""
    def mk(mode: str):
        p = policy(mode)
        p._state("d0").step_ratio = 1.8  # NOTE: streams there decode at ~0.13 s/token against a 0.15 s target
        return p

    req = RouteRequest(256, 32, 2.0, 0.15)
    remote = mk("always")(req, prefill(queued=950), decode(running=3))
    d = mk("auto")(req, prefill(queued=950), decode(running=3))
    assert not remote.admit and 0.2 < remote.p_slo < 0.5, remote
    assert d.admit and d.local and d.p_slo > 0.5 and d.p_slo > remote.p_slo, d


def test_a_pair_that_would_be_admitted_beats_one_that_would_be_refused() -> None:
    """Colocated: a worker whose own chance is low but who harms nobody does not hide another worker that
    would be admitted."""
    def mk():
        p = make_policy("goodput", router_cfg=RouterConfig(), slo=SLOConfig(ttft_ms=2000, tpot_ms=150))
        p._state("c1").step_ratio = 1.8
        return p

    now = time.time()
    # c0: a prefill queue, nothing decoding (P(own) below 0.5, no harm); c1: no queue, streams decoding near the
    # TPOT target (P(own) above 0.5, our prompt stalls them)
    c0 = WorkerStats("c0", "colocated", "n1", 4, 0, 950, 0, 0.0, 5760, (), True, now)
    c1 = WorkerStats("c1", "colocated", "n1", 0, 4, 0, 1200, 0.2, 5760, (), True, now)
    req = RouteRequest(256, 32, 2.0, 0.15)
    alone = [mk()(req, [], [c]) for c in (c0, c1)]
    assert not alone[0].admit and alone[1].admit, alone
    d = mk()(req, [], [c0, c1])
    assert d.admit and d.decode == "c1", d
