"""benchmarks.compare's pure logic: rates, side-by-side rows, goodput ratio, planner errors, tables."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.compare import tables
from benchmarks.compare.analysis import findings, foreign_load, side_by_side, slo_sweep
from benchmarks.compare.assemble import assemble, load_raw
from benchmarks.compare.cli import build_parser, check_args, main, write_outputs
from benchmarks.compare.deployment import Deployed, Deployment
from benchmarks.compare.fmt import fmt_ratio
from benchmarks.compare.metrics import metrics_of, ratio, slo_capacity
from benchmarks.compare.options import RunOptions
from benchmarks.compare.planner import (
    planner_rows,
    planner_table,
    predict_steps,
    prediction_error,
    sim_summary,
)
from benchmarks.compare.procstat import classify_process, cpu_breakdown
from benchmarks.compare.provenance import Provenance, header_lines, parse_cpu_model, parse_mem_total_gib
from benchmarks.compare.quality_check import TokenIdsOnly, quality_comparisons, quality_table
from benchmarks.compare.quiet import QuietBudget
from benchmarks.compare.runner import run_in_turn
from benchmarks.compare.server_stats import metric_means, parse_metrics, worker_load
from benchmarks.compare.shapes import MODES, QUALITY_SOURCES, deploy_config
from benchmarks.compare.tables import goodput_table, latency_table, sweep_table
from benchmarks.compare.traffic import Step, Traffic, parse_rates, rate_steps, request_stats
from benchmarks.compare.variant import Variant, parse_overrides
from benchmarks.compare.writer import json_safe, write_report_files
from placement.sim_result import RequestRecord as SimRecord


def summary(rate: float, goodput: float, attainment: float, ttft_p90: float = 0.5, tpot_p90: float = 0.08,
            errors: dict | None = None) -> dict:
    """A RateSummary.to_dict()-shaped dict with the fields compare reads."""
    lat = {"count": 10, "p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90 * 2, "mean": 0.0, "min": 0.0, "max": 1.0}
    tp = {"count": 10, "p50": tpot_p90 / 2, "p90": tpot_p90, "p99": tpot_p90 * 2, "mean": 0.0, "min": 0.0, "max": 1.0}
    itl = {"count": 100, "p50": 0.06, "p90": 0.07, "p99": 0.4, "mean": 0.0, "min": 0.0, "max": 1.0}
    return {"rate": rate, "duration_s": 10.0, "sent": 10, "succeeded": 10 - sum((errors or {}).values()),
            "rejected_429": 0, "errors": errors or {}, "ttft": lat, "itl": itl, "tpot": tp,
            "e2e": {"count": 10, "p50": 3.0, "p90": 4.0, "p99": 5.0, "mean": 3.0, "min": 1.0, "max": 5.0},
            "slo_met": round(attainment * 10), "attainment": attainment, "goodput_rps": goodput,
            "goodput_tok_s": goodput * 64, "request_throughput_rps": 1.0, "input_tok_s": 1.0, "output_tok_s": 64.0,
            "mean_tokens_per_chunk": 1.0, "max_send_lag_s": 0.001, "cost": None}


def test_parse_rates_accepts_commas_and_lists() -> None:
    assert parse_rates(["0.25,0.5", "1", "2,"]) == [0.25, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("bad", [["0"], ["-1"], ["x"], [","], ["inf"]])
def test_parse_rates_rejects_bad_values(bad: list[str]) -> None:
    with pytest.raises(ValueError, match="--rates"):
        parse_rates(bad)


def test_ratio_edge_cases() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 2.0) == 0.0
    assert ratio(1.0, 0.0) == math.inf
    assert ratio(0.0, 0.0) is None
    assert ratio(None, 1.0) is None
    assert fmt_ratio(1.5) == "1.50x"
    assert fmt_ratio(math.inf) == "inf (colocated 0)"
    assert fmt_ratio(None) == "n/a (both 0)"


def test_prediction_error_absolute_and_relative() -> None:
    e = prediction_error(0.12, 0.10)
    assert e["abs"] == pytest.approx(0.02)
    assert e["rel"] == pytest.approx(0.2)
    e = prediction_error(0.05, 0.10)
    assert e["rel"] == pytest.approx(-0.5)
    assert prediction_error(0.3, 0.0) == {"abs": 0.3, "rel": None}  # relative to 0: undefined
    assert prediction_error(0.0, 0.0) == {"abs": 0.0, "rel": None}
    assert prediction_error(None, 0.1) == {"abs": None, "rel": None}


def test_side_by_side_matches_rates_and_computes_ratio_and_winner() -> None:
    colo = [summary(0.5, 0.5, 1.0), summary(1.0, 0.6, 0.6, tpot_p90=0.12), summary(2.0, 0.0, 0.0)]
    # NOTE: disaggregated steps in another order: rows follow colocated's order, matched by rate.
    dis = [summary(2.0, 0.4, 0.2), summary(0.5, 0.5, 1.0), summary(1.0, 0.9, 0.9, errors={"timeout": 1})]
    rows = side_by_side(colo, dis)
    assert [r["rate"] for r in rows] == [0.5, 1.0, 2.0]
    assert rows[0]["goodput_ratio"] == pytest.approx(1.0) and rows[0]["winner"] == "tie"
    assert rows[1]["goodput_ratio"] == pytest.approx(1.5) and rows[1]["winner"] == "disaggregated"
    assert rows[1]["attainment_delta"] == pytest.approx(0.3)
    assert rows[1]["disaggregated"]["errors"] == 1 and rows[1]["disaggregated"]["succeeded"] == 9
    assert rows[1]["colocated"]["tpot_p90"] == 0.12 and rows[1]["colocated"]["ttft_p99"] == 1.0
    assert rows[2]["goodput_ratio"] == math.inf and rows[2]["winner"] == "disaggregated"


def test_side_by_side_rejects_mismatched_rates() -> None:
    with pytest.raises(ValueError, match="different rates"):
        side_by_side([summary(1.0, 1, 1)], [summary(2.0, 1, 1)])
    with pytest.raises(ValueError, match="once per mode"):
        side_by_side([summary(1.0, 1, 1)], [summary(1.0, 1, 1), summary(1.0, 1, 1)])


def test_goodput_table_is_markdown_with_one_row_per_rate() -> None:
    rows = side_by_side([summary(0.5, 0.25, 0.5), summary(1.0, 0.0, 0.0)],
                            [summary(0.5, 0.5, 1.0), summary(1.0, 0.0, 0.0)])
    table = goodput_table(rows).splitlines()
    assert table[0].startswith("| rate req/s | attain colo | attain disagg |")
    assert table[2] == "| 0.5 | 50% | 100% | 0.250 | 0.500 | 2.00x | disaggregated |"
    assert table[3] == "| 1 | 0% | 0% | 0.000 | 0.000 | n/a (both 0) | tie |"
    lat = latency_table(rows).splitlines()
    assert len(lat) == 2 + 4  # header, rule, 2 rates x 2 modes
    assert "| 0.5 | colocated | 250 / 500 / 1000 | 60 / 70 / 400 | 40 / 80 | 3000 | 10/10 |" in lat[2]


def test_slo_capacity_stops_at_first_miss() -> None:
    assert slo_capacity([0.25, 0.5, 1, 2], [1.0, 0.95, 0.8, 0.95], 0.9) == 0.5
    assert slo_capacity([2, 1], [0.9, 1.0], 0.9) == 2
    assert slo_capacity([0.5], [0.5], 0.9) is None


def test_sim_summary_uses_nearest_rank_and_benchmark_definitions() -> None:
    recs = [SimRecord(0.0, 100, 10, 0.2, 0.05, 1.0, 0, 0, False),
            SimRecord(1.0, 100, 10, 0.4, 0.07, 2.0, 0, 0, False),
            SimRecord(2.0, 100, 10, 0.9, 0.20, 4.0, 0, 0, False),
            SimRecord(3.0, 100, 10, float("nan"), float("nan"), float("nan"), 0, 0, True)]
    s = sim_summary(recs, ttft_slo=0.5, tpot_slo=0.1)
    assert s["requests"] == 4 and s["rejected"] == 1
    assert s["ttft_p50"] == 0.4 and s["ttft_p90"] == 0.9  # nearest rank over 3 values
    assert s["tpot_p50"] == 0.07
    assert s["attainment"] == pytest.approx(0.5)  # 2 met of 4 sent; the rejected one is a miss
    assert s["goodput_rps"] == pytest.approx(2 / 4.0)  # first arrival 0 to last finish 4


def test_planner_rows_pair_prediction_with_measurement() -> None:
    pred = {"colocated": {1.0: {"ttft_p50": 0.3, "ttft_p90": 0.6, "tpot_p50": 0.07, "tpot_p90": 0.09,
                                "attainment": 0.9, "goodput_rps": 0.9}},
            "disaggregated": {1.0: {"ttft_p50": 0.4, "ttft_p90": 1.0, "tpot_p50": 0.06, "tpot_p90": 0.08,
                                    "attainment": 1.0, "goodput_rps": 1.0}}}
    meas = {m: {1.0: metrics_of(summary(1.0, 0.8, 0.8, ttft_p90=0.5, tpot_p90=0.1))} for m in MODES}
    rows = planner_rows(pred, meas)
    assert [(r["rate"], r["mode"]) for r in rows] == [(1.0, "colocated"), (1.0, "disaggregated")]
    e = rows[0]["error"]
    assert e["ttft_p90"]["rel"] == pytest.approx(0.2)
    assert e["tpot_p90"]["rel"] == pytest.approx(-0.1)
    assert e["attainment"]["abs"] == pytest.approx(0.1)
    text = planner_table(rows)
    assert "600 vs 500 (+20%)" in text and "90% vs 80% (+10 pt)" in text


def test_quality_table_reports_first_divergence() -> None:
    comps = [{"a": "disaggregated", "b": "colocated", "exact_match_rate": 1.0,
              "prompts": [{"id": "p1", "match": True, "first_divergence": None, "unit": "token"}]},
             {"a": "disaggregated", "b": "offline", "exact_match_rate": 0.5,
              "prompts": [{"id": "p1", "match": True, "first_divergence": None, "unit": "token"},
                          {"id": "p2", "match": False, "first_divergence": 7, "unit": "token"}]}]
    lines = quality_table(comps).splitlines()
    assert lines[2] == "| disaggregated vs colocated | 100% (1/1) | - |"
    assert lines[3] == "| disaggregated vs offline | 50% (1/2) | p2@token 7 |"


def test_quality_comparisons_pairs_every_source() -> None:
    out = {"colocated": [{"id": "a", "text": "x y", "token_ids": [1, 2]}],
           "disaggregated": [{"id": "a", "text": "x y", "token_ids": [1, 2]}],
           "offline": [{"id": "a", "text": "x z", "token_ids": [1, 3]}]}
    comps = quality_comparisons(out, QUALITY_SOURCES)
    assert [(c["a"], c["b"]) for c in comps] == [("disaggregated", "colocated"), ("disaggregated", "offline"),
                                                  ("colocated", "offline")]
    assert [c["exact_match_rate"] for c in comps] == [1.0, 0.0, 0.0]
    assert comps[1]["prompts"][0]["first_divergence"] == 1
    # NOTE: without an order, sources pair in the order given (any variant names work).
    assert [(c["a"], c["b"]) for c in quality_comparisons(out)][0] == ("colocated", "disaggregated")


def test_machine_parsers() -> None:
    assert parse_cpu_model("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n") == \
        "Intel(R) Xeon(R) Processor"
    assert parse_cpu_model("") == "unknown"
    assert parse_mem_total_gib("MemTotal:       25165824 kB\nMemFree: 1 kB\n") == pytest.approx(24.0)


def test_cpu_breakdown_and_classification() -> None:
    assert classify_process("ray::ServeReplica:cmp-colo:Ingress", 5, 1).startswith("serve")
    assert classify_process("python -m benchmarks.compare", 1, 1) == "driver + load client"
    assert classify_process("/x/raylet --foo", 7, 1).startswith("ray system")
    before = {10: ("engine a", 5.0), 11: ("serve", 1.0), 12: ("engine a", 2.0)}
    after = {10: ("engine a", 9.0), 11: ("serve", 1.5), 12: ("engine a", 3.0), 13: ("engine a", 1.0)}
    # engine a: 4 + 1 + 1 (new process from 0) = 6 CPU-s over 10 s
    assert cpu_breakdown(before, after, 10.0) == {"engine a": 0.6, "serve": 0.05}


def test_worker_load_from_stats_samples() -> None:
    samples = [{"workers": [{"worker_id": "decode-0", "role": "decode", "running": 4, "waiting": 1,
                             "recent_step_times_s": [0.07, 0.08]}]},
               {"workers": [{"worker_id": "decode-0", "role": "decode", "running": 2, "waiting": 0,
                             "recent_step_times_s": [0.06]}]},
               {"workers": [{"worker_id": "decode-0", "role": "decode", "running": 0, "waiting": 0,
                             "recent_step_times_s": [9.0]}]}]
    w = worker_load(samples)["decode-0"]
    assert w["busy_fraction"] == pytest.approx(2 / 3)
    assert w["mean_running_when_busy"] == 3.0 and w["max_running"] == 4
    assert w["median_step_s"] == 0.07  # idle samples' step times are ignored
    assert w["mean_waiting"] == pytest.approx(1 / 3)
    assert w["spec_acceptance"] is None  # not a speculating engine


def test_speculation_acceptance_is_the_steps_own() -> None:
    def snap(drafted: int, accepted: int) -> dict:
        return {"workers": [{"worker_id": "decode-0", "role": "decode", "running": 1, "waiting": 0,
                             "spec_acceptance": round(accepted / drafted, 4), "spec_drafted": drafted,
                             "spec_accepted": accepted}]}

    # earlier traffic left 1000 drafted / 900 accepted; this step proposed 400 and accepted 100
    w = worker_load([snap(1000, 900), snap(1200, 950), snap(1400, 1000)])["decode-0"]
    assert w["spec_acceptance"] == 0.25 and w["spec_drafted"] == 400
    old = [{"workers": [{"worker_id": "decode-0", "role": "decode", "running": 1, "spec_acceptance": 0.6}]}]
    assert worker_load(old)["decode-0"]["spec_acceptance"] == 0.6  # engines without counters


def test_findings_name_the_colocated_miss_and_capacity() -> None:
    rows = side_by_side([summary(0.5, 0.5, 1.0), summary(1.0, 0.3, 0.3, tpot_p90=0.12)],
                            [summary(0.5, 0.5, 1.0), summary(1.0, 0.9, 0.9, tpot_p90=0.09)])
    res = {"disaggregated": {1.0: {"cpu_cores": {"engine prefill-0": 0.4, "engine decode-0": 0.9, "serve x": 0.2},
                                   "machine_other_cores": 0.1,
                                   "workers": {"decode-0": {"mean_running_when_busy": 5.0, "busy_fraction": 0.9}}}}}
    out = findings(rows, res, {"ttft_s": 2.0, "tpot_s": 0.1}, 0.9)
    assert "colocated 0.5 req/s, disaggregated 1.0 req/s" in out[0]
    assert "disaggregated higher at 1 of 2 rates (1)" in out[1]
    assert "colocated misses the 100 ms TPOT target at p90, disaggregated meets it" in out[3]
    assert "engines 1.30 (prefill-0 0.40, decode-0 0.90), rest of ours 0.20, not ours 0.10" in out[3]


def test_json_safe_and_deploy_config() -> None:
    assert json.loads(json.dumps(json_safe({1.0: [math.inf, 1.0]}))) == {"1.0": ["inf", 1.0]}
    args = build_parser().parse_args(["--num-requests", "4"])
    colo = deploy_config(args, "colocated", 8123)
    dis = deploy_config(args, "disaggregated", 8123)
    assert colo["pools"] == {"colocated": 2} and dis["pools"] == {"prefill": 1, "decode": 1}
    assert colo["serve"]["port"] == dis["serve"]["port"] == 8123
    from cluster.config import parse_config

    assert parse_config(colo).mode == "colocated" and parse_config(dis).pools.decode == 1


def test_check_args_requires_a_bound_and_valid_modes() -> None:
    p = build_parser()
    with pytest.raises(ValueError, match="--num-requests"):
        check_args(p.parse_args([]))
    with pytest.raises(ValueError, match="--modes"):
        check_args(p.parse_args(["--num-requests", "4", "--modes", "colocated,bogus"]))
    rates, modes = check_args(p.parse_args(["--duration", "10", "--rates", "1,2"]))
    assert rates == [1.0, 2.0] and modes == ["colocated", "disaggregated"]


def test_parse_metrics_and_interval_means() -> None:
    text = ("# HELP saaf_ttft_seconds Time to first token\n"
            'saaf_ttft_seconds_bucket{le="0.5"} 3.0\n'
            "saaf_ttft_seconds_sum 2.0\nsaaf_ttft_seconds_count 4.0\n"
            "saaf_prefill_seconds_sum 1.0\nsaaf_prefill_seconds_count 4.0\n"
            "saaf_itl_seconds_sum 9.0\n")
    m1 = parse_metrics(text)
    assert m1 == {"saaf_ttft_seconds_sum": 2.0, "saaf_ttft_seconds_count": 4.0,
                  "saaf_prefill_seconds_sum": 1.0, "saaf_prefill_seconds_count": 4.0}
    m0 = {"saaf_ttft_seconds_sum": 1.0, "saaf_ttft_seconds_count": 2.0}
    means = metric_means(m0, m1)
    assert means["ttft"] == pytest.approx(0.5)  # (2 - 1) / (4 - 2)
    assert means["prefill"] == pytest.approx(0.25)
    assert means["kv_transfer"] is None  # no samples in the interval


def _rec(i: int, ttft: float, e2e: float, tokens: int, ok: bool = True) -> dict:
    return {"index": i, "input_len": 10, "output_len": tokens, "scheduled_s": 0.0, "start_s": 0.0,
            "status": 200 if ok else 500, "ttft_s": ttft if ok else None, "e2e_s": e2e if ok else None,
            "itl_s": [], "chunks": tokens, "prompt_tokens": 10, "completion_tokens": tokens if ok else 0,
            "usage_reported": True, "error_kind": None if ok else "http_500", "error": None}


def test_slo_sweep_rejudges_the_same_records() -> None:
    # TPOT = (e2e - ttft) / (tokens - 1): 0.09 s and 0.06 s for colocated; 0.07 s twice for disaggregated.
    records = {"colocated": {1.0: [_rec(0, 0.5, 0.5 + 0.09 * 10, 11), _rec(1, 0.5, 0.5 + 0.06 * 10, 11)]},
               "disaggregated": {1.0: [_rec(0, 0.9, 0.9 + 0.07 * 10, 11), _rec(1, 3.0, 3.0 + 0.07 * 10, 11)]}}
    durations = {"colocated": {1.0: 10.0}, "disaggregated": {1.0: 10.0}}
    rows = slo_sweep(records, durations, ttft_s=2.0, tpot_targets=[0.08, 0.1])
    at80, at100 = rows
    assert at80["colocated"]["attainment"] == 0.5 and at80["disaggregated"]["attainment"] == 0.5
    assert at100["colocated"]["attainment"] == 1.0 and at100["disaggregated"]["attainment"] == 0.5
    assert at100["goodput_ratio"] == pytest.approx(0.5)
    table = sweep_table(rows).splitlines()
    assert table[2] == "| 80 | 50% / 50% (1.00x) |" and table[3] == "| 100 | 100% / 50% (0.50x) |"


def test_token_ids_only_transport_drops_options_our_api_rejects() -> None:
    import httpx

    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "x", "token_ids": [5]}]})

    t = TokenIdsOnly()
    t._inner = httpx.MockTransport(handler)
    with httpx.Client(transport=t) as client:
        client.post("http://h/v1/completions", json={"prompt": "p", "return_token_ids": True,
                                                     "return_tokens_as_token_ids": True, "logprobs": 0})
    assert seen == [{"prompt": "p", "return_token_ids": True}]


def _raw() -> dict:
    rates = [0.5, 1.0]
    colo_steps = [summary(0.5, 0.5, 1.0), summary(1.0, 0.3, 0.3, tpot_p90=0.12)]
    dis_steps = [summary(0.5, 0.5, 1.0), summary(1.0, 0.9, 0.9, tpot_p90=0.09)]
    res = {"wall_s": 10.0, "cpu_cores": {"engine decode-0": 0.9, "serve (ingress)": 0.1}, "machine_busy_cores": 1.2,
           "machine_other_cores": 0.2,
           "workers": {"decode-0": {"role": "decode", "samples": 9, "busy_fraction": 0.9, "mean_running_when_busy": 3.0,
                                    "max_running": 5, "mean_waiting": 0.0, "median_step_s": 0.07}},
           "transfers": {"count": 2, "outcomes": {"ok": 2}, "transfer_wait_p50_s": 0.05, "transfer_wait_p90_s": 0.1,
                         "handoff_p50_s": 0.01, "kv_bytes_mean": 1.0, "decode_computed_prompt_tokens_max": 1},
           "server_means_s": {"ttft": 0.5, "prefill": 0.3, "kv_transfer": 0.05, "queue_wait": None}}
    recs = [_rec(0, 0.5, 1.4, 11), _rec(1, 0.5, 1.1, 11)]
    pred = {m: {r: {"ttft_p50": 0.3, "ttft_p90": 0.6, "tpot_p50": 0.07, "tpot_p90": 0.09, "attainment": 1.0,
                    "goodput_rps": r} for r in rates} for m in MODES}
    header = {"command": "python -m benchmarks.compare --num-requests 2", "started_at": "2026-01-01T00:00:00+00:00",
              "finished_at": "2026-01-01T00:10:00+00:00", "runtime_s": 600.0,
              "machine": {"nproc": 2, "memory_gib": 24.0, "cpu_model": "Xeon", "loadavg": ["1", "2", "3"]},
              "machine_end": {"loadavg": ["1", "1", "1"]}, "git": {"commit": "abc", "dirty": True},
              "model": "smollm2", "rates": rates, "num_requests": 2, "duration_s": None, "seed": 0,
              "policy": "least_loaded", "workload": {"name": "chat"}, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
              "attainment_target": 0.9, "tpot_targets": [0.08, 0.1], "profile": "manifests/profiles/x.yaml",
              "engine": {"max_model_len": 2048, "kv_cache_mib": 256},
              "shapes": {"colocated": {"engines": 2, "pools": {"colocated": 2}},
                         "disaggregated": {"engines": 2, "pools": {"prefill": 1, "decode": 1}}}}
    q = [{"id": "a", "text": "x", "token_ids": [1]}]
    return {"report": header,
            "parts": {"colocated": {"steps": colo_steps, "resources": {0.5: res, 1.0: res}},
                      "disaggregated": {"steps": dis_steps, "resources": {0.5: res, 1.0: res}}},
            "records": {m: {r: recs for r in rates} for m in MODES}, "pred": pred,
            "quality_outputs": {"colocated": q, "disaggregated": q,
                                "offline": [{"id": "a", "text": "y", "token_ids": [2]}]},
            "offline_error": None}


def test_report_rebuilds_from_raw_json(tmp_path) -> None:
    (tmp_path / "raw.json").write_text(json.dumps(json_safe(_raw())))
    report = assemble(load_raw(tmp_path / "raw.json"))
    assert [r["goodput_ratio"] for r in report["rows"]] == pytest.approx([1.0, 3.0])
    assert report["slo_capacity"] == {"colocated": 0.5, "disaggregated": 1.0}
    assert not report["quality"]["all_match"]
    assert write_outputs(report, tmp_path) == 1  # the offline difference is a bug: exit status 1
    md = (tmp_path / "report.md").read_text()
    for text in ("## Goodput", "## Planner check", "## The same requests judged at other TPOT targets",
                 "## Quality: greedy outputs", "This is a bug to report to the lead", "## Where the CPU went",
                 "git commit: `abc` (working tree had uncommitted changes)", "| 1 | 30% | 90% |"):
        assert text in md
    assert json.loads((tmp_path / "report.json").read_text())["rows"][1]["winner"] == "disaggregated"
    assert main(["--from-raw", str(tmp_path / "raw.json")]) == 1


def test_foreign_load_flags_steps_with_other_peoples_cpu() -> None:
    res = {"colocated": {0.5: {"machine_other_cores": 0.7}, 1.0: {"machine_other_cores": 0.0}},
           "disaggregated": {0.5: {"machine_other_cores": 0.1}, 1.0: {"machine_other_cores": 0.3}}}
    fl = foreign_load(res, 0.25)
    assert fl["rates"] == [0.5, 1.0]
    assert fl["steps"] == {"colocated 0.5": 0.7, "disaggregated 1": 0.3}
    rows = side_by_side([summary(0.5, 0.5, 1.0)], [summary(0.5, 0.5, 1.0)])
    assert "| 0.5 (!) |" in goodput_table(rows, fl["rates"])


def test_foreign_load_flags_steps_the_host_stole_from_only_when_the_run_set_a_steal_limit() -> None:
    res = {"colocated": {0.5: {"machine_other_cores": 0.0, "machine_steal_cores": 0.3}},
           "disaggregated": {0.5: {"machine_other_cores": 0.0, "machine_steal_cores": 0.02},
                             1.5: {"machine_other_cores": 0.0, "machine_steal_cores": 0.12}}}
    fl = foreign_load(res, 0.25, 0.1)
    assert fl["rates"] == [0.5, 1.5] and fl["steps"] == {}
    assert fl["steal_steps"] == {"colocated 0.5": 0.3, "disaggregated 1.5": 0.12}
    old = foreign_load(res, 0.25)  # NOTE: a run from before the steal limit rebuilds as it was
    assert old["rates"] == [] and "steal_steps" not in old


def test_wait_quiet_waits_out_host_steal_within_its_budget() -> None:
    from benchmarks.compare.quiet import QuietBudget, wait_quiet

    readings = iter([(0.0, 0.4), (0.0, 0.3), (0.05, 0.02)])
    budget = QuietBudget(wait_left=10.0, retries_left=0)
    gate = wait_quiet(budget, 0.25, 0.1, window_s=1.0, measure=lambda w: next(readings))
    assert gate["steal_cores_at_start"] == 0.02 and gate["foreign_cores_at_start"] == 0.05
    assert budget.wait_left == 8.0
    stuck = QuietBudget(wait_left=2.0, retries_left=0)
    gate = wait_quiet(stuck, 0.25, 0.1, window_s=1.0, measure=lambda w: (0.0, 0.5))
    assert gate["steal_cores_at_start"] == 0.5 and stuck.wait_left == 0.0  # NOTE: bounded: gives up


def test_a_step_the_host_stole_from_is_repeated_and_the_cleaner_attempt_kept(monkeypatch) -> None:
    from types import SimpleNamespace

    from benchmarks.compare import step as step_mod
    from benchmarks.compare.options import RunOptions
    from benchmarks.compare.quiet import QuietBudget
    from benchmarks.stats import SLO

    def attempt(other: float, steal: float, att: float) -> step_mod.Attempt:
        summ = SimpleNamespace(attainment=att, goodput_rps=att, ttft=SimpleNamespace(p90=1.0),
                               tpot=SimpleNamespace(p90=0.1))
        return step_mod.Attempt(SimpleNamespace(steps=[SimpleNamespace(summary=summ)]),
                                {"machine_other_cores": other, "machine_steal_cores": steal, "cpu_cores": {}})

    runs = iter([attempt(0.0, 0.3, 0.6), attempt(0.05, 0.02, 0.9), attempt(0.0, 0.0, 1.0)])
    monkeypatch.setattr(step_mod, "measure_step", lambda *a: next(runs))
    monkeypatch.setattr(step_mod, "wait_quiet", lambda *a: {"waited_s": 0.0})
    opts, out = RunOptions(slo=SLO(2.0, 0.15), say=lambda line: None), step_mod.Replayed()
    budget = QuietBudget(wait_left=0.0, retries_left=2)
    got = step_mod.best_attempt("http://127.0.0.1:1", "m", SimpleNamespace(key=0.5), {}, opts, budget, False,
                                "x", out)
    assert got.resources["machine_steal_cores"] == 0.02 and budget.retries_left == 1
    assert [d["machine_steal_cores"] for d in out.discarded] == [0.3]
    # NOTE: with no retries left, a stolen-from step is kept as it is (and flagged in the report)
    runs = iter([attempt(0.0, 0.3, 0.6)])
    got = step_mod.best_attempt("http://127.0.0.1:1", "m", SimpleNamespace(key=1.5), {}, opts,
                                QuietBudget(0.0, 0), False, "x", out)
    assert got.resources["machine_steal_cores"] == 0.3


# ---------------------------------------------------------------------------------------------------
# The generic pieces a later comparison reuses: variants, traffic, planner over any variant, runner
# ---------------------------------------------------------------------------------------------------

def test_variant_merges_nested_overrides_without_touching_the_base() -> None:
    base = {"engine": {"model": "smollm2", "kv_cache_mib": 256}, "router": {"policy": "least_loaded"}}
    v = Variant("goodput", {"router": {"policy": "goodput"}, "pools": {"prefill": 2}})
    assert v.config(base) == {"engine": {"model": "smollm2", "kv_cache_mib": 256},
                              "router": {"policy": "goodput"}, "pools": {"prefill": 2}}
    assert base["router"] == {"policy": "least_loaded"} and "pools" not in base
    parsed = Variant.parse("x", ["router.policy=goodput", "engine.kv_cache_mib=128",
                                     "engine.enable_prefix_caching=true", "name=cmp-x"])
    assert parsed.overrides == {"router": {"policy": "goodput"}, "name": "cmp-x",
                                "engine": {"kv_cache_mib": 128, "enable_prefix_caching": True}}
    for bad in (["router.policy"], ["=1"], ["a=1", "a.b=2"]):
        with pytest.raises(ValueError, match="override"):
            parse_overrides(bad)


def test_traffic_requests_are_what_run_benchmark_sends() -> None:
    import inspect

    from benchmarks.serve import run_benchmark_async
    from benchmarks.workload import ChatWorkload, build_requests

    t = Traffic(ChatWorkload(64, 0.5, 16, 0.5), num_requests=5, duration_s=None, seed=3, max_total_len=70)
    assert t.requests(2.0) == build_requests(t.workload, 2.0, 5, None, 1.0, 3, 70)
    assert t.requests(2.0) != Traffic(t.workload, 5, None, seed=4, max_total_len=70).requests(2.0)
    assert set(t.bench_kwargs()) <= set(inspect.signature(run_benchmark_async).parameters)
    steps = rate_steps(t, [0.5, 1.0])
    assert [(s.key, s.rate) for s in steps] == [(0.5, 0.5), (1.0, 1.0)]
    stats = request_stats(t.requests(1.0))
    assert stats["requests"] == 5 and stats["mean_input"] + stats["mean_output"] <= 70


def test_planner_predicts_any_variant_and_skips_planner_chosen_pools() -> None:
    from benchmarks.compare.shapes import DEFAULT_PROFILE
    from benchmarks.stats import SLO
    from benchmarks.workload import LongDocWorkload

    t = Traffic(LongDocWorkload(256, 8), num_requests=4, duration_s=None)
    configs = {"colo3": {"mode": "colocated", "pools": {"colocated": 3}},
               "p2d1": {"mode": "disaggregated", "pools": {"prefill": 2, "decode": 1}},
               "auto": {"mode": "disaggregated", "pools": "auto", "planner": {}}}
    steps = [Step("1/seed0", 1.0, t), Step("1/seed1", 1.0, Traffic(t.workload, 4, None, seed=1))]
    pred, lens = predict_steps(DEFAULT_PROFILE, configs, steps, SLO(2.0, 0.1))
    assert set(pred["colo3"]) == set(pred["p2d1"]) == {"1/seed0", "1/seed1"} and pred["auto"] == {}
    assert lens["1/seed0"]["requests"] == 4 and pred["colo3"]["1/seed0"]["requests"] == 4
    measured = {n: {k: dict(p, attainment=0.5) for k, p in pred[n].items()} for n in ("p2d1", "colo3")}
    rows = planner_rows(pred, measured, names=["p2d1", "colo3"])
    assert [(r["rate"], r["mode"]) for r in rows] == [("1/seed0", "p2d1"), ("1/seed0", "colo3"),
                                                      ("1/seed1", "p2d1"), ("1/seed1", "colo3")]
    assert "| 1/seed0 | p2d1 |" in planner_table(rows)


def test_rekey_restores_rates_and_keeps_other_keys() -> None:
    from benchmarks.compare.writer import rekey

    assert rekey({"0.5": 1, "1/seed1": 2}) == {0.5: 1, "1/seed1": 2}


def test_dirty_paths_skip_results_files_wherever_they_come_in_the_status() -> None:
    from benchmarks.compare.provenance import dirty_paths

    # the first entry starts with a space: it was misread when the whole output was stripped
    status = " M benchmarks/results/a/report.json\0?? benchmarks/results/b/\0 M cluster/config.py\0" \
             "R  docs/new.md\0docs/old.md\0?? tests/unit/test_x.py\0"
    assert dirty_paths(status) == ["cluster/config.py", "docs/new.md", "tests/unit/test_x.py"]
    assert dirty_paths(" M benchmarks/results/a/raw.json\0") == [] and dirty_paths("") == []


def test_provenance_header_and_report_files(tmp_path) -> None:
    prov = Provenance.start(["python", "-m", "x"], ["--a", "b c"])
    report = {**prov.start_fields(), **prov.end_fields(), "value": math.inf}
    assert report["command"] == "python -m x --a 'b c'" and set(report["git"]) >= {"commit", "dirty"}
    lines = header_lines(report, "shared box")
    assert lines[3] == report["command"] and lines[-2].endswith("; shared box")
    assert lines[-1].startswith(f"- git commit: `{report['git']['commit']}`")
    def plot(out_dir) -> list[str]:
        (out_dir / "p.png").write_bytes(b"")
        return ["p.png"]

    paths = write_report_files(tmp_path / "r", report, lambda plots: "# r\n" + " ".join(plots), plot)
    assert [p.name for p in paths] == ["report.md", "report.json", "p.png"]
    assert json.loads((tmp_path / "r" / "report.json").read_text())["value"] == "inf"
    assert (tmp_path / "r" / "report.md").read_text() == "# r\np.png"


class _FakeDeployment(Deployment):
    def __init__(self) -> None:
        super().__init__({"pools": {"colocated": 1}})
        self.stopped = 0

    def start(self, ready_timeout_s: float) -> Deployed:
        return Deployed("http://127.0.0.1:9", "m", 1.0, [], {})

    def stop(self) -> int:
        self.stopped += 1
        return 0


def test_run_variant_always_tears_down_and_run_in_turn_keeps_what_finished(monkeypatch) -> None:
    from benchmarks.compare import runner
    from benchmarks.stats import SLO

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("endpoint went away")

    monkeypatch.setattr(runner, "replay_steps", boom)
    opts = RunOptions(slo=SLO(1.0, 0.1), quality=False, probe_requests=0, reset_affinity=False,
                          say=lambda _line: None)
    deps: dict[str, _FakeDeployment] = {}

    def run_one(v: Variant) -> dict:
        if v.name == "b":
            raise KeyboardInterrupt  # NOTE: SIGTERM arrives as KeyboardInterrupt inside embedded_ray
        deps[v.name] = _FakeDeployment()
        if v.name == "c":
            return runner.run_variant(v.name, deps[v.name], [Step(1.0, 1.0, None)], opts, QuietBudget(0, 0))
        return {"steps": []}

    parts, failure = run_in_turn([Variant("a", {}), Variant("b", {}), Variant("c", {})], run_one)
    assert list(parts) == ["a"] and failure == "KeyboardInterrupt: "
    parts, failure = run_in_turn([Variant("c", {})], run_one)
    assert parts == {} and failure == "RuntimeError: endpoint went away" and deps["c"].stopped == 1
    with pytest.raises(ValueError, match="unique"):
        run_in_turn([Variant("a", {}), Variant("a", {})], run_one)
    with pytest.raises(ValueError, match="no steps"):
        runner.run_variant("d", _FakeDeployment(), [], opts, QuietBudget(0, 0))


def test_host_steal_is_counted_apart_from_processes_not_ours(monkeypatch) -> None:
    """Time the hypervisor gives other guests is no process of this machine: it is reported as steal, not as
    busy cores (where it read as load "not ours" and could fail a step's quiet check)."""
    from benchmarks.compare import procstat
    from engine import procs

    ticks = iter([
        [100, 0, 50, 1000, 0, 0, 0, 0, 0, 0],    # user nice system idle iowait irq softirq steal guest guest_nice
        [100, 0, 50, 1000, 0, 0, 0, 0, 0, 0],
        [300, 0, 50, 1100, 0, 0, 0, 100, 0, 0],  # +2 s user, +1 s steal (at 100 ticks/s)
        [300, 0, 50, 1100, 0, 0, 0, 100, 0, 0],
    ])
    monkeypatch.setattr(procs, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(procs.os, "sysconf", lambda name: 100)
    b0, s0 = procs.machine_busy_s(), procs.machine_steal_s()
    assert (procs.machine_busy_s() - b0, procs.machine_steal_s() - s0) == (2.0, 1.0)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(procstat.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(procstat, "machine_steal_s", iter([3.0, 4.0]).__next__)
    assert procstat.Steal().cores() == 0.5
    row = {"cpu_cores": {}, "workers": {}, "transfers": {}, "machine_other_cores": 0.0, "machine_steal_cores": 0.5}
    assert "(0.50)" in tables._resource_cells(row, 0.25)[2]
