"""What admission made of each request, $/M tokens per shape, and the router's prediction ratios, as
``benchmarks.compare`` reports them (pure, from stored records)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import pytest

from benchmarks.client import RequestRecord
from benchmarks.compare.outcomes import outcome, outcomes, router_rows, within
from benchmarks.stats import SLO, summarize

SLO_ = {"ttft_s": 1.0, "tpot_s": 0.1}
SHAPES = {"colocated": {"pools": {"colocated": 2}}, "disaggregated": {"pools": {"prefill": 1, "decode": 1}}}


def _rec(i: int, status: int, ttft: float | None = None, e2e: float | None = None, out: int = 11) -> RequestRecord:
    ok = status == 200
    return RequestRecord(i, 100, out, 0.0, status=status, ttft_s=ttft, e2e_s=e2e,
                         prompt_tokens=100 if ok else 0, completion_tokens=out if ok else 0,
                         error_kind=None if ok else ("rejected_429" if status == 429 else f"http_{status}"))


def _step() -> list[RequestRecord]:
    return [_rec(0, 200, 0.5, 1.5),     # TPOT 0.1: met
            _rec(1, 200, 1.5, 2.0),     # TTFT past 1 s: late
            _rec(2, 200, 0.5, 2.5),     # TPOT 0.2: late
            _rec(3, 429, e2e=0.004), _rec(4, 429, e2e=0.030),
            _rec(5, 502, e2e=3.0)]


def test_outcome_counts_met_late_refused_failed_and_refusal_times() -> None:
    o = outcome(_step(), SLO(**SLO_))
    assert (o["sent"], o["met"], o["late"], o["refused"], o["failed"]) == (6, 1, 2, 2, 1)
    assert o["refusal_p50_s"] == pytest.approx(0.004) and o["refusal_max_s"] == pytest.approx(0.030)
    # the summary every benchmark prints agrees on the same records
    s = summarize(_step(), 10.0, 1.0, SLO(**SLO_))
    assert (s.slo_met, s.served_late, s.rejected_429, s.refusal.max) == (1, 2, 2, pytest.approx(0.030))


def test_refusals_recorded_before_their_time_was_kept_have_no_time() -> None:
    o = outcome([_rec(0, 429)], SLO(**SLO_))
    assert o["refused"] == 1 and o["refusal_p50_s"] is None


def test_cost_per_shape_and_blended_cost() -> None:
    recs = {m: {1.0: [asdict(r) for r in _step()]} for m in SHAPES}
    durations = {m: {1.0: 36.0} for m in SHAPES}  # 36 s at $10/h = $0.10
    out = outcomes(recs, durations, SLO_, SHAPES, 10.0)
    d = out["disaggregated"][1.0]
    # three answered requests: 300 input, 33 output tokens; one prefill and one decode engine split the $0.10
    assert d["dollars_per_m_input"] == pytest.approx(0.05 / 300 * 1e6)
    assert d["dollars_per_m_output"] == pytest.approx(0.05 / 33 * 1e6)
    for m in SHAPES:
        assert out[m][1.0]["dollars_per_m_tokens"] == pytest.approx(0.10 / 333 * 1e6)
    c = out["colocated"][1.0]  # colocated: split by time in prefill (sum TTFT 2.5 s) vs decode (3.5 s)
    assert c["dollars_per_m_input"] == pytest.approx(0.10 * 2.5 / 6.0 / 300 * 1e6)
    assert outcomes(recs, durations, SLO_, SHAPES, None)["colocated"][1.0]["dollars_per_m_input"] is None


def test_router_rows_and_how_many_ratios_lie_within_the_tolerance() -> None:
    def pred(ttft: tuple[float, float], tpot: tuple[float, float]) -> dict:
        return {"count": 5, "ttft": {"p50_ratio": ttft[0], "p90_ratio": ttft[1]},
                "tpot": {"p50_ratio": tpot[0], "p90_ratio": tpot[1]}}

    resources = {"disaggregated": {1.5: {"router_predictions": pred((0.8, 1.3), (1.0, 1.1))},
                                   0.5: {"router_predictions": pred((1.0, 1.0), (0.7, 1.25))}},
                 "colocated": {0.5: {"router_predictions": {"count": 0}}}}  # a baseline predicts nothing
    rows = router_rows(resources)
    assert [(r["rate"], r["mode"]) for r in rows] == [(0.5, "disaggregated"), (1.5, "disaggregated")]
    w = within(rows)
    assert w["ttft"] == {"within": 3, "of": 4} and w["tpot"] == {"within": 3, "of": 4}


def test_prediction_summary_reports_the_per_request_log_error_mean_and_spread() -> None:
    from benchmarks.compare.server_stats import prediction_summary

    # (seq, predicted TTFT, measured TTFT, predicted TPOT, measured TPOT) as GET /v1/stats lists them
    errs = (0.1, -0.1, 0.3, -0.3)
    entries = [(i, 0.5, 0.5 * math.exp(e), 0.1, 0.2) for i, e in enumerate(errs)]
    entries.append((9, 0.5, 0.6, None, None))  # a 1-token request: no TPOT predicted
    s = prediction_summary(entries)
    assert s["count"] == 5
    t = s["ttft"]
    assert t["log_error_mean"] == pytest.approx(math.log(0.6 / 0.5) / 5, abs=1e-3)
    assert len(t["pairs"]) == 5
    p = s["tpot"]  # every request twice as slow as predicted: bias ln 2, no spread
    assert p["log_error_mean"] == pytest.approx(math.log(2), abs=1e-3) and p["log_error_sd"] == 0
    four = prediction_summary(entries[:4])["ttft"]
    assert four["log_error_mean"] == pytest.approx(0, abs=1e-3)
    assert four["log_error_sd"] == pytest.approx(math.sqrt(0.05), abs=1e-3)


def test_prediction_summary_keeps_where_each_prompt_was_prefilled() -> None:
    from benchmarks.compare.server_stats import prediction_summary
    from cluster.router import RouteRequest, make_policy
    from engine.contract import WorkerStats

    p = make_policy("goodput", disaggregation="auto")
    now = time.time()
    pre = [WorkerStats("p0", "prefill", "", 0, 0, 0, 0, 0.0, 5760, (), True, now)]
    dec = [WorkerStats("d0", "decode", "", 0, 0, 0, 0, 0.0, 5760, (), True, now)]
    for prompt in (40, 900):  # NOTE: a short prompt on the idle decode worker, a long one on the prefill worker
        d = p(RouteRequest(prompt, 16, 2.0, 0.2), pre, dec)
        p.observe(d, RouteRequest(prompt, 16, 2.0, 0.2), 0.3, 0.05)
    s = prediction_summary(list(p.predictions))
    assert s["ttft"]["placements"] == [e[5] for e in p.predictions] == ["local:idle decode", "remote:cheaper"]
    old = prediction_summary([e[:5] for e in p.predictions])  # NOTE: a router that does not report them
    assert "placements" not in old["ttft"] and len(old["ttft"]["pairs"]) == 2
