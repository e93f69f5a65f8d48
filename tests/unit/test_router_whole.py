"""`router.disaggregation: auto` can also run a whole request on a prefill worker (cluster/router/one_engine.py):
when the decode pool is the bottleneck and a prefill worker has time to spare. Its streams share the engine
with the prompts routed there, and a prompt routed there later pays for stalling them."""

from __future__ import annotations

import time

from cluster.config import RouterConfig, SLOConfig
from cluster.router import RouteRequest, make_policy
from cluster.router.one_engine import LOCAL_PER_SNAPSHOT
from engine.stats import WorkerStats

LONG = RouteRequest(900, 32, 2.0, 0.15)  # TTFT near its target: every saving counts


def policy(mode: str = "auto"):
    return make_policy("goodput", router_cfg=RouterConfig(disaggregation=mode), slo=SLOConfig(ttft_ms=2000,
                                                                                                   tpot_ms=150))


def prefill(wid: str = "p0", *, running: int = 0, decoding: int = 0, queued: int = 0, ctx: int = 300) -> WorkerStats:
    return WorkerStats(wid, "prefill", "n1", queued // 250, running, queued, running * ctx, running * ctx / 5760, 5760,
                       (), True, time.time(), decoding=decoding)


def decode(running: int = 0, ctx_each: int = 300) -> list[WorkerStats]:
    return [WorkerStats("d0", "decode", "n1", 0, running, 0, running * ctx_each, running * ctx_each / 5760, 5760,
                        (), True, time.time())]


def test_a_slow_decode_batch_sends_the_whole_request_to_an_idle_prefill_worker() -> None:
    p = policy()
    d = p(LONG, [prefill()], decode(running=12))
    assert d.admit and d.local and d.whole and d.prefill is None and d.decode == "p0", d
    assert d.placement == "whole:cheaper" and p.describe()["placements"] == {"whole:cheaper": 1}
    remote = policy("always")(LONG, [prefill()], decode(running=12))
    assert remote.decode == "d0" and not remote.local and not remote.whole
    # NOTE: no KV transfer, and its tokens come from a lone stream, not the 13-stream batch
    assert d.predicted_ttft_s < remote.predicted_ttft_s and d.predicted_tpot_s < remote.predicted_tpot_s
    assert d.p_slo > remote.p_slo + p.tie_probability


def test_an_idle_decode_worker_keeps_the_decoding_and_ties_go_to_the_two_engine_path() -> None:
    d = policy()(LONG, [prefill()], decode(running=2))
    assert not d.whole and d.prefill == "p0" and d.decode == "d0", d
    short = policy()(RouteRequest(256, 32, 2.0, 0.15), [prefill()], decode(running=6))
    assert not short.whole, short  # NOTE: a lone request meets both targets either way


def test_a_prefill_worker_busy_with_prompts_has_no_time_to_decode() -> None:
    """Prompts routed there took 70% of its time over the last 10 s: a stream there gets 30% of its steps."""
    p = policy()
    p._state("p0").add_prefill_load(time.time(), 7.0)
    d = p(LONG, [prefill()], decode(running=12))
    assert not d.whole and d.decode == "d0", d


def test_whole_requests_are_not_the_prefill_workers_queue() -> None:
    idle = policy("always")(LONG, [prefill()], decode()).predicted_ttft_s
    streams = policy("always")(LONG, [prefill(running=3, decoding=3)], decode()).predicted_ttft_s
    prompts = policy("always")(LONG, [prefill(running=3, decoding=0)], decode()).predicted_ttft_s
    assert streams == idle != prompts


def test_a_prompt_goes_where_it_stalls_no_whole_request() -> None:
    """p0 is a little faster, but four streams decode there: a 900-token prompt would stall each of them."""
    pool = [prefill("p0"), prefill("p1", queued=40)]
    assert policy("always")(LONG, pool, decode()).prefill == "p0"
    pool[0] = prefill("p0", running=4, decoding=4)
    d = policy("always")(LONG, pool, decode())
    assert d.prefill == "p1", d


def test_a_burst_within_one_stats_interval_sends_at_most_two_whole_requests_per_prefill_worker() -> None:
    p = policy()
    ps, ds = [prefill()], decode(running=12)
    got = [p(RouteRequest(400, 64, 2.0, 0.15), ps, ds) for _ in range(6)]
    assert sum(d.whole for d in got) == LOCAL_PER_SNAPSHOT == 2, got
    # NOTE: the next ones count the streams routed there: their TPOT prediction grows
    whole = [d.predicted_tpot_s for d in got if d.whole]
    assert whole[1] > whole[0]


def test_whole_requests_learn_the_prefill_workers_corrections() -> None:
    p = policy()
    d = p(LONG, [prefill()], decode(running=12))
    assert d.whole
    p.observe_first_token(d, LONG, d.predicted_ttft_s * 2)
    p.observe(d, LONG, d.predicted_ttft_s * 2, d.predicted_tpot_s * 2)
    assert p.states["p0"].ttft_ratio > 1.0 and p.states["p0"].tpot_ratio > 1.0
    assert p.states["d0"].tpot_ratio == 1.0
