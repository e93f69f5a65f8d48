"""Goodput policy on synthetic WorkerStats (no Ray): predictions, choice, admission, affinity, feedback."""

from __future__ import annotations

import pytest

from cluster.router import RouteRequest, latency_from_config
from cluster.router.goodput import GoodputPolicy
from cluster.router.policy import prefix_ladder
from engine.contract import WorkerStats
from placement.latency import LatencyModel

LAT = latency_from_config(None)  # the bundled CPU SmolLM2 profile: prefill ~1.55 ms/token + 72 ms


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pw(i: int, queued: int = 0, waiting: int = 0, running: int = 0, ts: float = 1000.0, node: str = "") -> WorkerStats:
    return WorkerStats(f"p{i}", "prefill", node, waiting, running, queued, 0, 0.0, 5760, (), True, ts)


def dw(i: int, running: int = 0, ctx: int = 0, kv: float = 0.0, steps: tuple[float, ...] = (), ts: float = 1000.0,
       node: str = "") -> WorkerStats:
    return WorkerStats(f"d{i}", "decode", node, 0, running, 0, ctx, kv, 5760, steps, True, ts)


def policy(**kw) -> GoodputPolicy:
    kw.setdefault("clock", Clock())
    return GoodputPolicy(LAT, default_ttft_s=2.0, default_tpot_s=0.2, **kw)


def req(prompt: int = 200, out: int = 64, ttft: float = 2.0, tpot: float = 0.2, prefix: int = 0) -> RouteRequest:
    return RouteRequest(prompt, out, ttft, tpot, prefix)


def test_idle_prediction_is_the_latency_model() -> None:
    """The prefill's first token streams at once: the KV transfer delays the second token (a share of it per
    output token in TPOT), not the first."""
    d = policy()(req(300, 64), [pw(0)], [dw(0)])
    assert d.admit and (d.prefill, d.decode) == ("p0", "d0") and d.reason == "goodput"
    assert d.predicted_ttft_s == pytest.approx(LAT.prefill_time_s([300]))
    assert d.predicted_tpot_s == pytest.approx(LAT.decode_step_time_s(1, 300 + 32)
                                               + LAT.kv_transfer_time_s(300, False) / 63)
    assert d.p_slo == pytest.approx(1.0, abs=1e-4)


def test_a_first_token_the_decode_engine_samples_waits_for_the_transfer() -> None:
    """Structured output, penalties, a seed or stop strings: the decode engine samples token 1 after the KV
    has moved (cluster/serve/leg.py first_token_carries), so the transfer counts in TTFT."""
    d = policy()(req(300, 64)._replace(first_from_prefill=False), [pw(0)], [dw(0)])
    assert d.predicted_ttft_s == pytest.approx(LAT.prefill_time_s([300]) + LAT.kv_transfer_time_s(300, False))
    assert d.predicted_tpot_s == pytest.approx(LAT.decode_step_time_s(1, 300 + 32))


def test_queue_wait_counts_in_ttft() -> None:
    ttfts = [policy()(req(), [pw(0, queued=q, waiting=q // 200)], [dw(0)]).predicted_ttft_s for q in (0, 400, 1200)]
    assert ttfts[0] < ttfts[1] < ttfts[2]
    # 1200 queued tokens in 6 requests + ours: one batch of 1400 tokens, ~2.2 s on the CPU profile
    assert ttfts[2] == pytest.approx(LAT.prefill_time_from_sums(1400, 6 * 200**2 + 200**2))


def test_the_engines_reported_step_budget_wins_over_the_configured_one() -> None:
    """A queue longer than one step pays one more batch's fixed cost per step: with the 4096-token fallback
    1200 queued tokens are one batch, with the 512 the engine reports (WorkerStats.step_tokens) three."""
    p = policy()
    q = pw(0, queued=1200, waiting=6)
    fallback = p(req(), [q], [dw(0)]).predicted_ttft_s
    reported = policy()(req(), [q._replace(step_tokens=512)], [dw(0)]).predicted_ttft_s
    assert p.max_prefill_tokens == 4096
    assert reported == pytest.approx(fallback + 2 * LAT.terms.p_fixed)


def test_long_queue_and_big_batch_are_avoided() -> None:
    d = policy()(req(), [pw(0, queued=1500, waiting=5), pw(1, queued=100, waiting=1)],
                 [dw(0, running=30, ctx=9000, kv=0.5), dw(1, running=3, ctx=900, kv=0.5)])
    assert (d.prefill, d.decode) == ("p1", "d1")


def test_full_kv_cache_is_avoided_and_oversized_requests_refused() -> None:
    # d0 has the smaller batch but only ~60 free KV tokens: we would wait for requests to finish.
    p = policy()
    d = p(req(300, 16), [pw(0)], [dw(0, running=8, ctx=2000, kv=0.99), dw(1, running=12, ctx=2400, kv=0.5)])
    assert d.decode == "d1"
    big = p(req(5000, 1000, ttft=30.0), [pw(0)], [dw(0)])  # more KV than the worker has
    assert not big.admit and "TPOT inf" in big.reason


def test_unmeetable_ttft_is_refused_but_names_the_best_pair() -> None:
    d = policy()(req(ttft=1.0), [pw(0, queued=3000, waiting=8), pw(1, queued=2000, waiting=6)], [dw(0)])
    assert not d.admit
    assert "TTFT" in d.reason and "vs 1.000 s" in d.reason
    assert (d.prefill, d.decode) == ("p1", "d0")  # best-effort admission serves it there
    assert d.predicted_ttft_s > 1.0 and d.p_slo < 0.5


def test_refused_requests_are_booked_only_for_best_effort() -> None:
    stats = ([pw(0, queued=3000, waiting=8)], [dw(0)])
    for record, booked in ((False, 0), (True, 1)):
        p = policy(record_refused=record)
        p(req(ttft=1.0), *stats)
        assert len(p.states["p0"].led) == booked


def test_routes_the_stats_do_not_show_yet_spread_the_load() -> None:
    # Stats refresh every 100 ms; a burst in between must not all land on the same workers.
    pre, dec = [pw(i) for i in range(4)], [dw(i) for i in range(4)]
    p = policy()
    picks = [p(req(400, 100), pre, dec) for _ in range(8)]
    assert {d.prefill for d in picks} == {"p0", "p1", "p2", "p3"}
    assert {d.decode for d in picks} == {"d0", "d1", "d2", "d3"}
    # Once a snapshot taken after the routes shows them, the ledger stops adding them again.
    clock = p.clock
    clock.t += 0.1
    fresh = [pw(i, queued=800, waiting=2, ts=clock.t) for i in range(4)]
    d = p(req(400, 100), fresh, dec)
    assert d.predicted_ttft_s == pytest.approx(
        LAT.prefill_time_from_sums(1200, 2 * 400**2 + 400**2))


def test_a_long_prompt_does_not_push_a_queued_request_past_its_deadline() -> None:
    pre = [pw(0, queued=300, waiting=1, running=1), pw(1, queued=450, waiting=2, running=1)]
    assert policy()(req(900, ttft=6.0), pre, [dw(0)]).prefill == "p0"  # alone, p0 is the faster one
    p = policy()
    first = p(req(200, ttft=1.0), pre, [dw(0)])  # ours, now queued on p0 with a tight budget
    assert first.admit and first.prefill == "p0"
    later = p(req(900, ttft=6.0), pre, [dw(0)])
    assert later.admit and later.prefill == "p1"


def test_prefix_affinity_breaks_ties_but_not_load() -> None:
    p = policy()
    first = p(req(prefix=42), [pw(0), pw(1)], [dw(0)])
    clock = p.clock
    clock.t += 1
    tie = [pw(0, ts=clock.t), pw(1, ts=clock.t)]
    other = "p1" if first.prefill == "p0" else "p0"
    assert p(req(prefix=7), tie, [dw(0, ts=clock.t)]).prefill == first.prefill  # lowest index on a tie
    assert p(req(prefix=42), [s._replace(queued_prompt_tokens=30, waiting=1) if s.worker_id == first.prefill else s
                              for s in tie], [dw(0, ts=clock.t)]).prefill == first.prefill
    clock.t += 1
    busy = [pw(0, queued=2500, waiting=8, ts=clock.t) if first.prefill == "p0" else pw(0, ts=clock.t),
            pw(1, queued=2500, waiting=8, ts=clock.t) if first.prefill == "p1" else pw(1, ts=clock.t)]
    assert p(req(prefix=42), busy, [dw(0, ts=clock.t)]).prefill == other


def test_a_cached_prefix_makes_its_worker_cheaper_by_the_cached_tokens() -> None:
    """A follow-up turn (the last prompt + more) is predicted on the worker that prefilled the last prompt
    without the tokens its prefix cache holds (the longest shared rung of the ladder: 512 of 1000), so it
    goes there past a shorter queue elsewhere; a prompt sharing only its first 64 tokens gets no hit."""
    first = list(range(600))
    follow = first + list(range(5000, 5400))
    other = first[:64] + list(range(9000, 9936))
    p = policy()
    d0 = p(req(len(first), prefix=1)._replace(prefixes=prefix_ladder(first)), [pw(0), pw(1, queued=800)], [dw(0)])
    assert d0.prefill == "p0"
    workers = [pw(0, queued=300, waiting=1), pw(1)]
    d1 = p(req(len(follow))._replace(prefixes=prefix_ladder(follow)), workers, [dw(0)])
    assert d1.prefill == "p0" and p.prefix_hit_tokens == 512
    # NOTE: p0's snapshot (as new as the first route) holds its 300 queued tokens; ours adds 1000 - 512
    assert d1.predicted_ttft_s == pytest.approx(
        LAT.prefill_time_from_sums(300 + 488, 300**2 + 1000**2 - 512**2))
    d2 = p(req(len(other))._replace(prefixes=prefix_ladder(other)), workers, [dw(0)])
    assert d2.prefill == "p1" and p.prefix_hit_tokens == 512


def test_observed_slowness_moves_requests_away() -> None:
    p = policy()
    pre, dec = [pw(0), pw(1)], [dw(0), dw(1)]
    d = p(req(), pre, dec)
    for _ in range(20):
        p.observe(d, req(), ttft_s=3 * d.predicted_ttft_s, tpot_s=3 * d.predicted_tpot_s)
    assert p.states[d.prefill].ttft_ratio > 2 and p.states[d.decode].tpot_ratio > 2
    clock = p.clock
    clock.t += 1
    again = p(req(), [pw(0, ts=clock.t), pw(1, ts=clock.t)], [dw(0, ts=clock.t), dw(1, ts=clock.t)])
    assert again.prefill != d.prefill and again.decode != d.decode


def test_decode_step_times_calibrate_tpot() -> None:
    model = LAT.decode_step_time_s(10, 3000)
    slow = dw(0, running=10, ctx=3000, steps=(2 * model,) * 8)
    fast = dw(1, running=10, ctx=3000, steps=(model,) * 8)
    p = policy(ewma_alpha=1.0)
    d = p(req(), [pw(0)], [slow, fast])
    assert d.decode == "d1"
    assert p.states["d0"].step_ratio == pytest.approx(2.0)


def test_batch_already_there_keeps_its_tighter_target() -> None:
    # Default TPOT 0.2 s. This request accepts 1 s, but joining d0 would push its 38 requests past 0.2 s.
    loaded = dw(0, running=38, ctx=4000, kv=0.3)
    assert LAT.decode_step_time_s(39, 4300) > 0.2 > LAT.decode_step_time_s(38, 4000)
    solo = policy()(req(tpot=1.0), [pw(0)], [loaded])
    assert not solo.admit and solo.p_slo > 0.99 and "net of others" in solo.reason
    d = policy()(req(tpot=1.0), [pw(0)], [loaded, dw(1, running=10, ctx=4000, kv=0.3)])
    assert d.admit and d.decode == "d1"


def test_same_node_transfer_is_preferred() -> None:
    p = policy()
    d = p(req(1000, ttft=5.0), [pw(0, node="a"), pw(1, node="b")], [dw(0, node="b")])
    assert d.prefill == "p1"
    assert d.predicted_ttft_s == pytest.approx(LAT.prefill_time_s([1000]))
    assert d.predicted_tpot_s == pytest.approx(LAT.decode_step_time_s(1, 1000 + 32)
                                               + LAT.kv_transfer_time_s(1000, True) / 63)
    late = p(req(1000, ttft=5.0)._replace(first_from_prefill=False), [pw(0, node="a"), pw(1, node="b")],
             [dw(0, node="b")])
    assert late.prefill == "p1"
    assert late.predicted_ttft_s == pytest.approx(LAT.prefill_time_s([1000]) + LAT.kv_transfer_time_s(1000, True))


def test_colocated_mode_routes_to_one_worker() -> None:
    co = [WorkerStats(f"c{i}", "colocated", "", q // 300, 0, q, 0, 0.1, 5760, (), True, 1000.0)
          for i, q in enumerate((1500, 0))]
    d = policy()(req(), [], co)
    assert d.admit and d.prefill is None and d.decode == "c1"
    assert d.predicted_ttft_s == pytest.approx(LAT.prefill_time_s([200]))


def test_prompts_a_worker_prefills_beside_its_streams_slow_them_by_their_share_of_its_time() -> None:
    """A colocated engine spends part of its time on prompts: the decode steps get the rest, so TPOT = step /
    (1 - share of the last 10 s). Seen live: at 1.5 req/s the colocated router predicted TPOT p90 0.55x what
    was measured and served 9 of 30 requests late. (A decode engine's local prefills are in the step times
    its step correction learns from: not counted twice.)"""
    from cluster.router.goodput_state import PREFILL_LOAD_WINDOW_S

    co = [WorkerStats("c0", "colocated", "", 0, 2, 0, 600, 0.1, 5760, (), True, 1000.0)]
    prefill_s = LAT.terms.pa * 400 + LAT.terms.pb * 400 * 400 + LAT.terms.p_lin * 400
    tpots = []
    for forget in (False, True):  # the same routes, the second time with the booked load forgotten
        clock = Clock()
        p = policy(clock=clock)
        assert p(req(400, 32), [], co).admit
        if forget:
            p.states["c0"].pload.clear()
        clock.t += 1.0
        d = p(req(400, 32), [], co)
        tpots.append(d.predicted_tpot_s)
    # the first prompt's prefill took prefill_s of the last 10 s of the worker's time
    assert tpots[0] == pytest.approx(tpots[1] / (1 - prefill_s / PREFILL_LOAD_WINDOW_S), rel=1e-9)
    assert tpots[0] > tpots[1]
    clock.t += PREFILL_LOAD_WINDOW_S + 1  # the load has passed
    assert p.states["c0"].prefill_share(clock.t) == 0.0
    # a decode worker pays nothing here, also for the prompts it prefills itself (auto)
    for mode in ("always", "auto"):
        pure = policy(disaggregation=mode)
        d = pure(req(40, 32), [pw(0, queued=3000, waiting=10)], [dw(0, running=2, ctx=600)])
        assert d.local == (mode == "auto") and not pure.states["d0"].pload


def test_a_cached_prefix_is_predicted_only_on_an_engine_that_caches_prefixes() -> None:
    """Affinity still breaks ties, but an engine without a prefix cache computes every prompt token: the
    compare benchmark (prefix caching off, the same prompts at every rate) was predicted hits that never came."""
    prompt = list(range(300))
    ladder = prefix_ladder(prompt)
    r = RouteRequest(300, 16, 2.0, 0.2, ladder[0][1], prefixes=ladder)
    for caching in (True, False):
        p = policy()
        pre = [pw(0)._replace(prefix_caching=caching), pw(1)._replace(prefix_caching=caching)]
        first = p(r, pre, [dw(0)])
        again = p(r, pre, [dw(0)])
        assert again.prefill == first.prefill  # the same worker either way (affinity)
        assert (p.prefix_hit_tokens > 0) == caching


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="max_tokens >= 1, got 200 and 0"):
        policy()(RouteRequest(200, 0, 1.0, 0.1), [pw(0)], [dw(0)])
    with pytest.raises(ValueError, match="sigma=0"):
        GoodputPolicy(LAT, sigma=0)
    assert not policy()(req(), [pw(0)], []).admit


def test_other_latency_models_work() -> None:
    from placement.catalog import get_hardware, get_model

    gpu = LatencyModel.from_catalog(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))
    d = GoodputPolicy(gpu, clock=Clock())(req(2000, 200, ttft=0.5, tpot=0.05), [pw(0)], [dw(0)])
    assert d.admit and d.predicted_ttft_s < 0.5 and d.predicted_tpot_s < 0.05


def test_a_slowdown_learnt_from_step_times_is_not_learnt_again_from_the_same_requests_tpot() -> None:
    """The decode worker is 3x slower than the model. Its step times during a request teach the step
    correction 3x; that request's observed TPOT (3x the prediction made before) must not teach the TPOT
    correction another 3x: a lone request would then be predicted 9x slow and refused (seen live)."""
    model = LAT.decode_step_time_s(1, 300)
    p = policy(ewma_alpha=1.0)
    d = p(req(), [pw(0)], [dw(0, running=0, ctx=0)])
    assert d.admit and d.corrections.step_ratio == pytest.approx(1.0)
    p(req(), [pw(0)], [dw(0, running=1, ctx=300, steps=(3 * model,) * 8)])  # stats while it runs
    assert p.states["d0"].step_ratio == pytest.approx(3.0)
    p.observe(d, req(), ttft_s=d.predicted_ttft_s, tpot_s=3 * d.predicted_tpot_s)
    st = p.states["d0"]
    assert st.tpot_ratio == pytest.approx(1.0) and st.tpot_ratio * st.step_ratio == pytest.approx(3.0)


def test_a_speculating_decode_engine_is_predicted_at_its_measured_acceptance() -> None:
    """Issue 15: with `speculative_tokens` k, a decode worker that reports an acceptance rate a is predicted
    with LatencyModel.with_speculation(k, a); its engine steps (each yields E tokens per sequence) are
    compared with the model's step x E, so a step time that matches the speculative model leaves the
    step correction at 1 and the TPOT prediction at the speculative one."""
    spec = LAT.with_speculation(4, 0.8)
    xfer = LAT.kv_transfer_time_s(300, False) / 63  # NOTE: the second token waits for the KV transfer
    plain = policy(speculative_tokens=4)(req(300, 64), [pw(0)], [dw(0)])  # no acceptance reported yet
    assert plain.predicted_tpot_s == pytest.approx(LAT.decode_step_time_s(1, 332) + xfer)
    fast = dw(0)._replace(spec_acceptance=0.8)
    d = policy(speculative_tokens=4)(req(300, 64), [pw(0)], [fast])
    assert d.predicted_tpot_s == pytest.approx(spec.decode_step_time_s(1, 332) + xfer)
    assert d.predicted_tpot_s < 0.6 * plain.predicted_tpot_s and spec.tokens_per_step == pytest.approx(3.3616)
    # a busy speculating engine whose measured steps are what the speculative model says for an engine step
    running, ctx = 4, 4 * 400
    step = spec.decode_step_time_s(running, ctx) * spec.tokens_per_step
    p = policy(speculative_tokens=4, ewma_alpha=0.5)
    busy = dw(0, running=running, ctx=ctx, steps=(step,) * 8)._replace(spec_acceptance=0.8)
    d = p(req(300, 64), [pw(0)], [busy])
    assert p.states["d0"].step_ratio == pytest.approx(1.0, abs=1e-6)
    assert d.predicted_tpot_s == pytest.approx(spec.decode_step_time_s(running + 1, ctx + 332) + xfer)
    # the same step times read by a policy that does not know the pool speculates: E times too slow
    q = policy(ewma_alpha=0.5)
    q(req(300, 64), [pw(0)], [busy])
    assert q.states["d0"].step_ratio > 1.2
    with pytest.raises(ValueError, match="speculative_tokens"):
        policy(speculative_tokens=-1)


def test_requests_that_share_a_prefill_step_are_judged_by_its_end() -> None:
    """Prompts waiting together are prefilled in one engine step and all get their first token at its end: a
    route that joins the step revises the earlier ones' TTFT predictions to its own, so a request that was
    delayed by later routes does not read as a slow worker (the correction stays at 1)."""
    p = policy(ewma_alpha=0.5)
    busy = pw(0, queued=200, waiting=1, running=1)  # one batch running, one request waiting
    ds = []
    for _ in range(3):  # NOTE: routed after the stats snapshot (ts 1000), which does not show them yet
        p.clock.t += 0.01
        ds.append(p(req(), [busy], [dw(0)]))
    ends = [d.predicted_ttft_s for d in ds]
    assert ends[0] < ends[1] < ends[2]  # each saw the queue of the earlier ones
    # what happened: they shared one step, which ended when the last one was predicted to (each request's TTFT
    # counts from its own routing, 10 ms apart)
    measured = [ends[2] + 0.01 * (2 - i) for i in range(3)]
    for d, m in zip(ds, measured, strict=True):
        p.observe(d, req(), m, 0.05)
    assert p.describe()["corrections"]["p0"]["ttft"] == pytest.approx(1.0, abs=1e-3)
    assert [m[1] for m in p.predictions] == pytest.approx(measured, abs=1e-3)


def test_routes_that_cannot_share_a_step_keep_their_own_prediction() -> None:
    """With a 256-token step budget two 200-token prompts are two steps: the first keeps its prediction, and
    observing it take as long as the second's is a slowdown the correction learns."""
    p = policy(ewma_alpha=0.5)
    busy = pw(0, queued=200, waiting=1, running=1)._replace(step_tokens=256)
    p.clock.t += 0.01
    first = p(req(), [busy], [dw(0)])
    p.clock.t += 0.01
    second = p(req(), [busy], [dw(0)])
    assert second.predicted_ttft_s > first.predicted_ttft_s
    p.observe(first, req(), second.predicted_ttft_s, 0.05)
    assert p.predictions[-1][1] == pytest.approx(first.predicted_ttft_s, abs=1e-3)
    assert p.describe()["corrections"]["p0"]["ttft"] > 1.05


def test_the_first_route_to_an_idle_engine_starts_its_own_step() -> None:
    """An engine idle in its stats prefills the first request that reaches it at once: a second route, though
    the stats do not show the first yet, does not revise the first one's prediction."""
    p = policy()
    p.clock.t += 0.01
    first = p(req(), [pw(0)], [dw(0)])
    p.clock.t += 0.01
    second = p(req(), [pw(0)], [dw(0)])
    assert second.predicted_ttft_s > first.predicted_ttft_s
    p.observe(first, req(), first.predicted_ttft_s, 0.05)
    assert p.predictions[-1][1] == pytest.approx(first.predicted_ttft_s, abs=1e-3)


def test_ttft_is_learnt_at_the_first_token_and_once() -> None:
    """A burst's late first tokens move the TTFT correction while its streams still decode (the next burst
    is routed with it), and the end of the stream does not learn the same TTFT again."""
    p = policy(ewma_alpha=0.5)
    pre, dec = [pw(0)], [dw(0)]
    d = p(req(), pre, dec)
    p.observe_first_token(d, req(), 2 * d.predicted_ttft_s)
    after_first = p.states["p0"].ttft_ratio
    assert after_first == pytest.approx(2 ** 0.5)  # NOTE: the EWMA (of logs, alpha 0.5) of 1.0 and 2
    p.observe(d, req(), 2 * d.predicted_ttft_s, d.predicted_tpot_s)
    assert p.states["p0"].ttft_ratio == after_first
    assert p.predictions[-1][1:3] == pytest.approx((d.predicted_ttft_s, 2 * d.predicted_ttft_s), abs=1e-3)
    # a caller that reports only the finished request still teaches the TTFT correction
    d2 = p(req(), pre, dec)
    p.observe(d2, req(), 2 * d2.predicted_ttft_s, d2.predicted_tpot_s)
    assert p.states["p0"].ttft_ratio > after_first


def test_a_burst_measured_after_it_was_routed_teaches_its_slowdown_once() -> None:
    """Ten requests routed together (correction 1) and each measured 2x slow say the correction should be 2,
    ten times; they must not compound it to 2^(10 alpha) (8x at alpha 0.3), which refused the next burst
    whole in the live admission test."""
    p = policy(ewma_alpha=0.3)
    pre, dec = [pw(0)], [dw(0)]
    burst = [p(req(200, 16, ttft=30.0, tpot=5.0), pre, dec) for _ in range(10)]
    assert all(d.admit and d.corrections.ttft_ratio == 1.0 and d.corrections.tpot_ratio == 1.0 for d in burst)
    # each TTFT as revised by the later routes into its prefill step (they share it), 2x late
    revised = [(lambda e: e[2] - e[0] + e[3])(p._tickets[d.corrections.ticket]) for d in burst]
    for d, ttft in zip(burst, revised, strict=True):
        p.observe(d, req(200, 16), 2 * ttft, 2 * d.predicted_tpot_s)
    st_p, st_d = p.states["p0"], p.states["d0"]
    assert 1.9 < st_p.ttft_ratio <= 2.0 and 1.9 < st_d.tpot_ratio <= 2.0
    # a request routed with the learnt correction and measured as predicted leaves it where it is
    d = p(req(), pre, dec)
    assert d.corrections.ttft_ratio == pytest.approx(st_p.ttft_ratio)
    before = st_p.ttft_ratio
    p.observe(d, req(), d.predicted_ttft_s, d.predicted_tpot_s)
    assert st_p.ttft_ratio == pytest.approx(before)


def test_tpot_is_predicted_at_the_batch_the_routed_load_settles_at() -> None:
    """A request decodes through a batch that turns over: with tau output tokens per second routed to a
    decode worker and one token per stream per step, the batch settles at tau x step (Little's law). A
    snapshot between two bursts shows fewer streams than the request will share its steps with."""
    from cluster.router.goodput_state import PREFILL_LOAD_WINDOW_S

    tpots = []
    for forget in (False, True):
        clock = Clock()
        p = policy(clock=clock)
        for _ in range(20):  # 20 requests of 64 tokens in 8 s, each into a snapshot that shows one stream
            p(req(100, 64, ttft=30.0, tpot=5.0), [pw(0, ts=clock.t)], [dw(0, running=1, ctx=200, ts=clock.t)])
            clock.t += 0.4
        if forget:
            p.states["d0"].dload.clear()
        tpots.append(p(req(100, 64), [pw(0, ts=clock.t)], [dw(0, running=1, ctx=200, ts=clock.t)]).predicted_tpot_s)
    steady = 20 * 64 / PREFILL_LOAD_WINDOW_S * tpots[1]  # tau x step: several streams, not the snapshot's 1
    assert steady > 4 and tpots[0] > 1.2 * tpots[1]
    # the batch it settles at: the model's step with those streams (each with our request's context)
    extra = steady - (p.states["d0"].b0 + 1)
    assert tpots[0] == pytest.approx(LAT.decode_step_time_s(1 + 1 + round(extra), 200 + (1 + extra) * 132),
                                     rel=0.15)


def test_a_prompt_that_would_push_a_colocated_batch_past_its_tpot_is_refused_or_sent_elsewhere() -> None:
    """A colocated engine prefills a new prompt in one of its streams' steps: each of their tokens waits for it.
    At a batch whose step sits near the TPOT target, that costs the streams there more than the newcomer
    gains (admission refuses it); the same prompt goes to an idle engine when there is one, and a batch far
    below the target takes it."""
    def co(wid: str, running: int) -> WorkerStats:
        return WorkerStats(wid, "colocated", "", 0, running, 0, running * 300, 0.1, 5760 * 4, (), True, 1000.0)

    full = policy()(req(600, 32), [], [co("c0", 24)])
    assert not full.admit and "no pair meets the targets" in full.reason
    assert full.p_slo > 0.8  # on its own it would most likely be in time: the refusal is for the others
    elsewhere = policy()(req(600, 32), [], [co("c0", 24), co("c1", 0)])
    assert elsewhere.admit and elsewhere.decode == "c1"
    assert policy()(req(600, 32), [], [co("c0", 4)]).admit


def test_a_tpot_correction_learnt_under_four_streams_applies_in_part_to_a_lone_one() -> None:
    """Requests routed into a batch of four and measured 1.4x slow teach the TPOT correction 1.4 at that batch
    (the stalls of the prefills that came with the streams, which the step model leaves out). A request that
    joins the batch the correction was learnt at is predicted with all of it; a lone stream with the share of
    it (in log space) that its batch is of that one: not refused for a slowdown of busy times."""
    p = policy(ewma_alpha=1.0)
    busy = dw(0, running=3, ctx=900)
    d = p(req(), [pw(0)], [busy])
    assert d.admit and d.corrections.tpot_batch == 4 and d.corrections.tpot_ratio == pytest.approx(1.0)
    p.observe(d, req(), ttft_s=d.predicted_ttft_s, tpot_s=1.4 * d.predicted_tpot_s)
    st = p.states["d0"]
    assert st.tpot_ratio == pytest.approx(1.4) and st.tpot_b == pytest.approx(4.0)
    # the same batch again: all of it
    again = policy(ewma_alpha=1.0)(req(), [pw(0)], [busy])
    d4 = p(req(), [pw(0)], [busy._replace(timestamp_s=1001.0)])
    assert d4.corrections.tpot_ratio == pytest.approx(1.4)
    assert d4.predicted_tpot_s == pytest.approx(1.4 * again.predicted_tpot_s, rel=0.02)
    # a lone stream, once the batch has gone (stats a second later: no stream, nothing on its way)
    d1 = p(req(), [pw(0)], [dw(0, ts=1001.0)])
    assert d1.corrections.tpot_batch == 1 and d1.corrections.tpot_ratio == pytest.approx(1.4 ** 0.25)
    # and what a lone stream measured as predicted teaches: the correction it was predicted with
    p.observe(d1, req(), ttft_s=d1.predicted_ttft_s, tpot_s=d1.predicted_tpot_s)
    assert st.tpot_ratio == pytest.approx(1.4 ** 0.25) and st.tpot_b == pytest.approx(1.0)
