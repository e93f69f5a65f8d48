"""Statistics on hand-made timings whose answers are worked out by hand in each test."""

from __future__ import annotations

import random

import pytest

from benchmarks.client import RequestRecord
from benchmarks.stats import SLO, CostModel, LatencySummary, cost_of, meets_slo, percentile, summarize, tpot


def ok(ttft: float, e2e: float, out: int, prompt: int = 100, itl: list[float] | None = None) -> RequestRecord:
    chunks = out if itl is None else len(itl) + 1
    return RequestRecord(0, prompt, out, 0.0, status=200, ttft_s=ttft, e2e_s=e2e, prompt_tokens=prompt,
                         completion_tokens=out, chunks=chunks, usage_reported=True, itl_s=itl or [])


def failed(status: int | None, kind: str) -> RequestRecord:
    return RequestRecord(0, 100, 10, 0.0, status=status, error_kind=kind, prompt_tokens=999, completion_tokens=999)


def test_percentile_nearest_rank_on_one_to_ten() -> None:
    values = list(range(1, 11))
    random.Random(1).shuffle(values)
    # rank = ceil(p/100 * 10): p50 -> 5th, p90 -> 9th, p99 -> 10th. Linear interpolation would give
    # 5.5 / 9.1 / 9.91; an off-by-one rank would give 6 / 10 / IndexError.
    assert percentile(values, 50) == 5
    assert percentile(values, 90) == 9
    assert percentile(values, 99) == 10
    assert percentile(values, 100) == 10
    assert percentile(values, 10) == 1


def test_percentile_hundred_values_and_float_rounding() -> None:
    values = [i / 100 for i in range(100, 0, -1)]  # 0.01 .. 1.00, reversed
    assert percentile(values, 50) == 0.50
    assert percentile(values, 90) == 0.90
    assert percentile(values, 99) == 0.99
    # 7 / 100 * 100 == 7.000000000000001 in floating point: a naive ceil would pick rank 8.
    assert percentile(values, 7) == 0.07
    assert percentile([3.0], 99) == 3.0


@pytest.mark.parametrize("p", [0, -1, 100.5])
def test_percentile_rejects_bad_p(p: float) -> None:
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], p)


def test_percentile_rejects_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_summary_is_percentiles_not_average() -> None:
    s = LatencySummary.of([1.0, 1.0, 1.0, 1.0, 100.0])
    # n=5: p50 -> rank 3 -> 1.0; p90 -> rank ceil(4.5)=5 -> 100; the mean is 20.8.
    assert (s.p50, s.p90, s.p99, s.count) == (1.0, 100.0, 100.0, 5)
    assert s.mean == pytest.approx(20.8)
    assert LatencySummary.of([]).p50 is None


def test_tpot() -> None:
    assert tpot(ok(ttft=0.5, e2e=2.5, out=11)) == pytest.approx(0.2)  # 2.0 s over 10 later tokens
    assert tpot(ok(ttft=0.5, e2e=0.5, out=1)) == 0.0
    assert tpot(failed(500, "http_500")) is None


def test_meets_slo_boundaries_are_inclusive() -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.2)
    assert meets_slo(ok(ttft=0.5, e2e=2.5, out=11), slo)  # exactly on both targets
    assert not meets_slo(ok(ttft=0.51, e2e=2.5, out=11), slo)
    assert not meets_slo(ok(ttft=0.5, e2e=2.6, out=11), slo)  # tpot 0.21
    assert not meets_slo(failed(429, "rejected_429"), slo)


def test_attainment_goodput_and_counts() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [ok(0.2, 1.0, 10) for _ in range(6)]  # tpot 0.8 / 9: met
    records.append(ok(1.5, 2.4, 10))  # ttft miss
    records.append(ok(0.2, 2.0, 10))  # tpot 0.2 miss
    records.append(failed(429, "rejected_429"))
    records.append(failed(None, "timeout"))
    s = summarize(records, duration_s=4.0, rate=2.0, slo=slo)
    assert (s.sent, s.succeeded, s.rejected_429, s.errors) == (10, 8, 1, {"timeout": 1})
    assert s.slo_met == 6
    assert s.attainment == pytest.approx(0.6)  # 6 met of 10 sent: errors and 429 are misses
    assert s.goodput_rps == pytest.approx(1.5)  # 6 met / 4 s
    assert s.goodput_tok_s == pytest.approx(15.0)  # 60 output tokens of met requests / 4 s
    assert s.request_throughput_rps == pytest.approx(2.0)  # 8 succeeded / 4 s
    assert s.output_tok_s == pytest.approx(20.0)  # failed requests' tokens are not counted
    assert s.input_tok_s == pytest.approx(200.0)
    # TTFT over the 8 successes: six 0.2, one 0.2, one 1.5 -> p50 0.2, p90 rank 8 -> 1.5
    assert s.ttft.p50 == 0.2 and s.ttft.p90 == 1.5 and s.ttft.count == 8


def test_itl_pools_every_chunk_gap() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    fast = ok(0.1, 0.19, 10, itl=[0.01] * 9)
    slow = ok(0.1, 0.6, 2, itl=[0.5])
    s = summarize([fast, slow], duration_s=1.0, rate=1.0, slo=slo)
    # 10 pooled gaps: nine 0.01 and one 0.5 -> p50 = p90 = 0.01 (rank 9), p99 = 0.5. Averaging
    # per-request means would say 0.255.
    assert (s.itl.count, s.itl.p50, s.itl.p90, s.itl.p99) == (10, 0.01, 0.01, 0.5)
    assert s.mean_tokens_per_chunk == pytest.approx(12 / 12)


def test_cost_disaggregated_splits_by_gpu_count() -> None:
    records = [ok(0.5, 2.0, out=2500, prompt=5000), ok(0.5, 2.0, out=2500, prompt=5000), failed(500, "http_500")]
    cost = cost_of(records, duration_s=100.0, model=CostModel(3.6, prefill_gpus=1, decode_gpus=3))
    # $3.6/h x 100 s = $0.10; prefill share 1/4 -> $0.025 over 10,000 input tokens = $2.5/M;
    # $0.075 over 5,000 output tokens = $15/M. The failed request's tokens are excluded.
    assert cost.total_dollars == pytest.approx(0.1)
    assert cost.prefill_fraction == pytest.approx(0.25)
    assert cost.dollars_per_m_input == pytest.approx(2.5)
    assert cost.dollars_per_m_output == pytest.approx(15.0)


def test_cost_colocated_splits_by_time_share() -> None:
    records = [ok(1.0, 4.0, out=1000, prompt=1000), ok(0.5, 2.0, out=1000, prompt=1000)]
    cost = cost_of(records, duration_s=3600.0, model=CostModel(8.0))
    # prefill time 1.5 s, decode time 3.0 + 1.5 = 4.5 s -> share 1.5 / 6 = 0.25; $8 total:
    # $2 / 2000 input tokens = $1000/M, $6 / 2000 output tokens = $3000/M.
    assert cost.prefill_fraction == pytest.approx(0.25)
    assert cost.dollars_per_m_input == pytest.approx(1000.0)
    assert cost.dollars_per_m_output == pytest.approx(3000.0)


def test_cost_and_slo_validation() -> None:
    with pytest.raises(ValueError, match="both"):
        CostModel(1.0, prefill_gpus=1)
    with pytest.raises(ValueError, match="dollars_per_hour"):
        CostModel(-1.0)
    with pytest.raises(ValueError, match="at least one GPU"):
        CostModel(1.0, prefill_gpus=0, decode_gpus=0)
    with pytest.raises(ValueError, match="tpot_s"):
        SLO(ttft_s=1.0, tpot_s=0.0)
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=0.0, rate=1.0, slo=SLO(1.0, 1.0))


def test_send_lag_shows_a_client_that_fell_behind_its_schedule() -> None:
    on_time, late = ok(0.1, 0.2, 2), ok(0.1, 0.2, 2)
    on_time.scheduled_s, on_time.start_s = 1.0, 1.001
    late.scheduled_s, late.start_s = 0.5, 0.75
    s = summarize([on_time, late], duration_s=2.0, rate=1.0, slo=SLO(1.0, 1.0))
    assert s.max_send_lag_s == pytest.approx(0.25)
