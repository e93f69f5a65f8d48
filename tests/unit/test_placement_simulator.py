"""Simulator invariants: every request accounted for, KV limits respected, monotone attainment,
closed loop, dispatch hook and explicit traces."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from placement import (
    Coefficients,
    InstanceView,
    LatencyModel,
    LengthDist,
    Request,
    RoundRobinDispatch,
    WorkloadSpec,
    gamma_trace,
    simulate_colocated,
    simulate_disaggregated,
)
from placement.workload import Workload

COEF = Coefficients(prefill_a=0.0948, prefill_b=4.03e-6, prefill_c=18.89, decode_a=6.11e-4, decode_b=0.0682,
                    decode_c=19.88)
CHAT = WorkloadSpec(input=LengthDist(kind="lognormal", mean=700, sd=400, max=1800),
                    output=LengthDist(kind="lognormal", mean=120, sd=100, max=600))


def lat(capacity: int = 60_000) -> LatencyModel:
    return LatencyModel.from_coefficients(COEF, kv_bytes_per_token=819_200, kv_capacity_tokens=capacity)


def test_every_request_accounted_for() -> None:
    reqs = Workload.from_spec(CHAT, 400, seed=1).at_rate(12.0)
    for res in (simulate_disaggregated(lat(), lat(), 2, 2, reqs), simulate_colocated(lat(), 3, reqs)):
        assert res.total == 400 and res.completed + res.rejected == 400 and res.rejected == 0
        for r in res.records:
            assert r.ttft_s > 0 and r.finish_s >= r.arrival_s + r.ttft_s - 1e-9
            assert r.tpot_s >= 0


class Capture:
    """Rejects every third request and records what it saw."""

    def __init__(self) -> None:
        self.n = 0
        self.max_kv_frac = 0.0

    def choose(self, now_s: float, prompt_len: int, output_len: int, prefill: Sequence[InstanceView],
               decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        self.n += 1
        for v in decode:
            assert v.role == "decode" and v.kv_used_tokens <= v.kv_capacity_tokens
            self.max_kv_frac = max(self.max_kv_frac, v.kv_used_tokens / v.kv_capacity_tokens)
        assert all(v.role == "prefill" for v in prefill)
        return None if self.n % 3 == 0 else (self.n % len(prefill), self.n % len(decode))


def test_dispatch_rejections_counted_and_kv_limit_respected() -> None:
    reqs = Workload.from_spec(CHAT, 300, seed=2).at_rate(40.0)
    pol = Capture()
    res = simulate_disaggregated(lat(), lat(capacity=8_000), 1, 2, reqs, dispatch=pol)
    assert pol.n == 300
    assert res.policy_rejected == 100 and res.rejected == 100 and res.completed == 200
    assert 0.5 < pol.max_kv_frac <= 1.0  # the small KV cache fills up at 40 req/s
    assert res.attainment(1e9, 1e9) == pytest.approx(200 / 300)


def test_prompts_waiting_for_decode_memory_hold_prefill_kv_and_stall_new_batches() -> None:
    """Decode memory for ~10 requests and a long decode: finished prompts wait on the prefill instance with their
    KV; a prefill instance holding 4 prompts' KV then stops taking batches (TTFT queues), one with room for all
    does not. Every request still completes and every block is released (the simulator asserts it)."""
    reqs = [Request(i * 0.05, 500, 200) for i in range(60)]
    roomy = simulate_disaggregated(lat(), lat(capacity=7_000), 1, 1, reqs)
    tight = simulate_disaggregated(lat(capacity=2_000), lat(capacity=7_000), 1, 1, reqs)
    assert roomy.completed == tight.completed == 60
    assert roomy.ttft().at("p90") < 1.0 and tight.ttft().at("p90") > 5.0
    # the wait for decode memory moves from after the first token (TPOT) to before it (TTFT)
    assert tight.tpot().at("p50") < roomy.tpot().at("p50") * 0.5


def test_request_too_long_for_kv_is_rejected_not_lost() -> None:
    reqs = [Request(0.0, 100, 10), Request(0.1, 5000, 10), Request(0.2, 100, 10)]
    res = simulate_disaggregated(lat(), lat(capacity=1000), 1, 1, reqs)
    assert [r.rejected for r in res.records] == [False, True, False]


def test_attainment_monotone_in_rate() -> None:
    wl = Workload.from_spec(CHAT, 400, seed=3)
    for mode, sim in (("disagg", lambda r: simulate_disaggregated(lat(), lat(), 1, 1, wl.at_rate(r))),
                      ("coloc", lambda r: simulate_colocated(lat(), 1, wl.at_rate(r)))):
        atts = [sim(rate).attainment(0.25, 0.1) for rate in (1, 2, 4, 6, 8, 12, 16)]
        assert all(a >= b - 1e-9 for a, b in zip(atts, atts[1:], strict=False)), (mode, atts)
        assert atts[0] > 0.85 and atts[-1] < 0.5, (mode, atts)


def test_disaggregation_removes_prefill_interference_from_tpot() -> None:
    reqs = Workload.from_spec(CHAT, 400, seed=4).at_rate(6.0)
    dis = simulate_disaggregated(lat(), lat(), 1, 1, reqs)
    col = simulate_colocated(lat(), 2, reqs)
    assert dis.tpot().p90 < col.tpot().p90


def test_closed_loop_keeps_concurrency() -> None:
    reqs = [Request(0.0, 512, 64)] * 100
    res = simulate_disaggregated(lat(), lat(), 1, 1, reqs, clients=4)
    assert res.completed == 100
    events = sorted([(r.arrival_s, 1) for r in res.records] + [(r.finish_s, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    assert peak == 4


def test_same_trace_two_policies_and_gamma_trace() -> None:
    d = LengthDist(kind="fixed", value=256)
    a = gamma_trace(500, 20.0, 2.0, d, LengthDist(kind="uniform", low=8, high=64), seed=7)
    b = gamma_trace(500, 20.0, 2.0, d, LengthDist(kind="uniform", low=8, high=64), seed=7)
    assert a == b
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert mean == pytest.approx(1 / 20.0, rel=0.15) and cv == pytest.approx(2.0, rel=0.25)
    rr = simulate_disaggregated(lat(), lat(), 2, 2, a, dispatch=RoundRobinDispatch())
    one = simulate_disaggregated(lat(), lat(), 2, 2, a, dispatch=_AllToZero())
    assert rr.total == one.total == 500
    assert {r.prefill for r in one.records} == {0} and {r.prefill for r in rr.records} == {0, 1}
    assert one.ttft().p90 > rr.ttft().p90


class _AllToZero:
    def choose(self, now_s: float, prompt_len: int, output_len: int, prefill: Sequence[InstanceView],
               decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        return 0, 0


def test_front_end_time_per_prompt_token_is_added_to_ttft_outside_the_engine() -> None:
    """`request_overhead_s_per_token` delays each request's entry by its prompt length: at a rate where
    nothing queues every TTFT grows by exactly that, and the engine's own times stay as they were."""
    reqs = [Request(i * 5.0, n, 8) for i, n in enumerate((100, 800, 1600))]
    base = lat()
    slow = LatencyModel.from_coefficients(COEF, kv_bytes_per_token=819_200, kv_capacity_tokens=60_000)
    slow.request_overhead_s_per_token = 50e-6
    for sim in (lambda m: simulate_colocated(m, 1, reqs), lambda m: simulate_disaggregated(m, m, 1, 1, reqs)):
        a, b = sim(base).records, sim(slow).records
        for ra, rb, r in zip(a, b, reqs, strict=True):
            assert rb.ttft_s - ra.ttft_s == pytest.approx(50e-6 * r.input_len, abs=1e-9)
            assert rb.tpot_s == pytest.approx(ra.tpot_s)


def test_front_end_time_per_stream_in_flight_is_added_to_ttft() -> None:
    """`request_overhead_s_per_stream` delays a request's entry by the requests in flight when it is sent:
    with a prefill pool of its own (no shared steps) the k-th of three overlapping requests gets exactly
    k times it on its TTFT (k / 2 with two front ends), and the decode steps stay as they were; a lone client
    never pays it."""
    base = lat()
    slow = LatencyModel.from_coefficients(COEF, kv_bytes_per_token=819_200, kv_capacity_tokens=60_000)
    slow.request_overhead_s_per_stream = 0.004
    reqs = [Request(0.0, 200, 2000), Request(1.0, 200, 2000), Request(2.0, 200, 8)]
    a = simulate_disaggregated(base, base, 1, 1, reqs).records
    b = simulate_disaggregated(slow, slow, 1, 1, reqs).records
    assert a[0].finish_s > 2.1 and a[1].finish_s > 2.1  # both still decoding when the third is sent
    assert [round(y.ttft_s - x.ttft_s, 9) for x, y in zip(a, b, strict=True)] == [0.0, 0.004, 0.008]
    assert b[0].tpot_s == pytest.approx(a[0].tpot_s, rel=0.01)
    # two decode instances stream the tokens: two front ends, each with half the requests in flight
    a2 = simulate_disaggregated(base, base, 1, 2, reqs).records
    b2 = simulate_disaggregated(slow, slow, 1, 2, reqs).records
    assert [round(y.ttft_s - x.ttft_s, 9) for x, y in zip(a2, b2, strict=True)] == [0.0, 0.002, 0.004]
    # one client: nobody else is ever in flight (finished requests leave the count), so nothing changes
    one = [Request(0.0, 200, 8) for _ in range(40)]
    for sim in (lambda m: simulate_colocated(m, 1, one, clients=1), lambda m: simulate_disaggregated(m, m, 1, 1, one, clients=1)):
        assert [r.ttft_s for r in sim(slow).records] == pytest.approx([r.ttft_s for r in sim(base).records])


def test_local_prefill_runs_short_prompts_on_the_decode_instance() -> None:
    """local_prefill_tokens: a short prompt skips the prefill pool and the KV transfer and is prefilled in a
    step of its decode instance (TTFT = that step alone when idle); the streams decoding there pay for it
    (TPOT up against remote prefill); long prompts still go remote; every request is accounted for."""
    m = lat()
    lone = simulate_disaggregated(m, m, 1, 1, [Request(0.0, 200, 16)], local_prefill_tokens=256).records[0]
    assert lone.ttft_s == pytest.approx(m.mixed_step_time_s(200, 200**2, 0, 0))
    remote = simulate_disaggregated(m, m, 1, 1, [Request(0.0, 200, 16)]).records[0]
    assert remote.ttft_s == pytest.approx(m.prefill_time_s([200]) + m.kv_transfer_time_s(200, False))
    # one long stream decoding, then short prompts arriving while it runs
    reqs = [Request(0.0, 1000, 200)] + [Request(0.5 + 0.4 * i, 100, 8) for i in range(10)]
    loc = simulate_disaggregated(m, m, 1, 1, reqs, local_prefill_tokens=256)
    rem = simulate_disaggregated(m, m, 1, 1, reqs)
    assert loc.completed == rem.completed == len(reqs)
    assert loc.records[0].ttft_s == pytest.approx(rem.records[0].ttft_s)  # 1000 tokens: remote in both
    assert loc.records[0].tpot_s > rem.records[0].tpot_s
    chat = Workload.from_spec(CHAT, 300, seed=3).at_rate(10.0)
    res = simulate_disaggregated(m, m, 1, 2, chat, local_prefill_tokens=400)
    assert res.completed + res.rejected == 300 and res.rejected == 0
    too_big = [Request(0.0, 100, 100_000)]  # more KV than a whole lane: rejected, in either mode
    for mode in ("both", "decode"):
        out = simulate_disaggregated(m, m, 1, 1, too_big, local_prefill_tokens=256, mode=mode)
        assert out.rejected == 1 and out.completed == 0
    with pytest.raises(ValueError, match="local prefill"):
        simulate_disaggregated(m, m, 1, 1, reqs, local_prefill_tokens=256, mode="prefill")


def test_first_token_from_prefill_moves_the_kv_transfer_from_ttft_to_tpot() -> None:
    """Our P/D streams the prefill's first token at once: TTFT ends at the prefill and the transfer delays
    token 2, so it shows up in TPOT spread over the output; the default keeps DistServe's convention."""
    m = lat()
    one = [Request(0.0, 2000, 11)]
    old = simulate_disaggregated(m, m, 1, 1, one).records[0]
    new = simulate_disaggregated(m, m, 1, 1, one, first_token_from_prefill=True).records[0]
    xfer = m.kv_transfer_time_s(2000, False)
    assert xfer > 0.001
    assert old.ttft_s == pytest.approx(m.prefill_time_s([2000]) + xfer)
    assert new.ttft_s == pytest.approx(m.prefill_time_s([2000]))
    assert new.finish_s == pytest.approx(old.finish_s)  # the same work, only where it is counted moves
    assert new.tpot_s == pytest.approx(old.tpot_s + xfer / 10)
    pre = simulate_disaggregated(m, m, 1, 1, one, mode="prefill", first_token_from_prefill=True).records[0]
    assert pre.ttft_s == pytest.approx(new.ttft_s)
