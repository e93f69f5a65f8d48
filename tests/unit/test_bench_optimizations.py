"""benchmarks.optimizations' logic: which deployment measures which workload, rows and quality per option."""

from __future__ import annotations

import pytest

from benchmarks import optimizations as opt


def test_every_option_has_its_baseline_and_both_workloads_on_both_deployments():
    by = {d.variant.name: d for d in opt.DEPLOYS}
    for o in opt.OPTIONS:
        for name in (o.variant, o.baseline):
            assert {o.helps, o.neutral} <= set(by[name].workloads), (o.name, name)
        # the option differs from its baseline only in engine options, never in shape
        assert by[o.variant].variant.overrides["pools"] == by[o.baseline].variant.overrides["pools"]
    assert all(w in opt.WORKLOADS for d in opt.DEPLOYS for w in d.workloads)


def test_disaggregated_variants_keep_the_kv_compatibility_fields():
    """NIXL's handshake compares model and dtypes: the per-pool option (speculation) validates."""
    from cluster.config import parse_config

    base = opt.base_config(opt.build_parser().parse_args([]), 8000)
    for d in opt.DEPLOYS:
        cfg = parse_config(d.variant.config(base))
        routing = d.variant.name == "disaggregated-2p+prefix-caching"  # the option is the routing itself
        assert cfg.engine.max_model_len == 2048
        assert cfg.router.policy == ("goodput" if routing else "least_loaded")
        if routing:  # serves every request, so only the routing differs from its baseline
            assert cfg.router.admission == "best_effort" and cfg.pools.prefill == 2


def _summary(ttft: float) -> dict:
    lat = {"p50": ttft, "p90": ttft, "p99": ttft * 2}
    return {"rate": 0.5, "sent": 4, "succeeded": 4, "errors": {}, "rejected_429": 0, "ttft": lat, "itl": lat,
            "tpot": lat, "e2e": lat, "attainment": 1.0, "slo_met": 4, "goodput_rps": 0.5, "goodput_tok_s": 1.0,
            "output_tok_s": 2.0, "duration_s": 8.0, "max_send_lag_s": 0.0,
            "cost": {"dollars_per_m_input": 1.0, "dollars_per_m_output": 2.0}}


def test_rows_pair_each_option_with_its_baseline_on_the_same_workload():
    parts = {"disaggregated": {"steps": [_summary(1.0), _summary(2.0), _summary(3.0), _summary(4.0)]},
             "disaggregated+prefix-caching": {"steps": [_summary(0.9), _summary(0.5)]},
             "disaggregated+speculation": {"steps": [_summary(4.4), _summary(3.3)], "resources": {
                 "templated": {"workers": {"decode-0": {"spec_acceptance": 0.6}}}}}}
    by = {d.variant.name: d for d in opt.DEPLOYS}
    metrics = {n: opt.step_metrics(p, by[n].workloads) for n, p in parts.items()}
    rows = opt.rows_of(metrics, {})
    got = {(r["option"], r["workload"]): (r["base"]["ttft_p50"], r["opt"]["ttft_p50"]) for r in rows}
    assert got == {("prefix caching", "multiturn"): (2.0, 0.5), ("prefix caching", "chat"): (1.0, 0.9),
                   ("n-gram speculation (4 tokens)", "templated"): (3.0, 3.3),
                   ("n-gram speculation (4 tokens)", "open"): (4.0, 4.4)}  # chunked prefill: not run
    spec = next(r for r in rows if r["workload"] == "templated")
    assert spec["spec_acceptance"] == 0.6 and "prefix caching" in opt.summary_table(rows)


def test_quality_counts_identical_greedy_outputs_against_the_baseline():
    same = [{"id": "a", "text": "x", "token_ids": [1, 2]}, {"id": "b", "text": "y", "token_ids": [3]}]
    other = [same[0], {"id": "b", "text": "z", "token_ids": [4]}]
    q = opt.quality_of({"disaggregated": same, "disaggregated+prefix-caching": same,
                        "disaggregated+speculation": other})
    assert q["prefix caching"]["identical"] == 2
    assert q["n-gram speculation (4 tokens)"]["identical"] == 1
    assert q["n-gram speculation (4 tokens)"]["first_divergences"][0][0] == "b"


@pytest.mark.parametrize("argv, msg", [
    (["--only", "nope"], "--only"), (["--num-requests", "0"], "--num-requests"),
    (["--workloads", "chat,nope"], "--workloads 'chat,nope': a comma list from chat,"),
    (["--only", "colocated", "--workloads", "open"], "none of them runs on colocated")])
def test_bad_arguments_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit):
        opt.main(argv)
    assert msg in capsys.readouterr().err


def test_the_int8_row_carries_task_accuracy_before_and_after():
    parts = {"disaggregated": {"steps": [_summary(1.0), _summary(2.0), _summary(3.0)]},
             "disaggregated+w8a8": {"steps": [_summary(1.5), _summary(2.5)]}}
    by = {d.variant.name: d for d in opt.DEPLOYS}
    metrics = {n: opt.step_metrics(p, by[n].workloads) for n, p in parts.items()}
    acc = {"disaggregated": {"saaf_capitals_mc/acc": 0.9, "saaf_capitals_mc/sample_len": 20.0},
           "disaggregated+w8a8": {"saaf_capitals_mc/acc": 0.8, "saaf_capitals_mc/sample_len": 20.0}}
    rows = opt.rows_of(metrics, {}, acc)
    assert {r["workload"] for r in rows} == {"chat", "multiturn"}
    assert all(r["accuracy"] == {"base": acc["disaggregated"], "opt": acc["disaggregated+w8a8"]} for r in rows)
    table = opt.summary_table(rows)
    assert "mc 0.90 -> 0.80" in table and "20.00" not in table  # lm-eval's sample count is not a score
    assert by["disaggregated+w8a8"].accuracy and by["disaggregated"].accuracy


def test_only_the_prefix_caching_variants_cache_prefixes():
    """Its steps are never repeated: a repeat would replay prompts the engine has cached."""
    base = opt.base_config(opt.build_parser().parse_args([]), 8000)
    caching = {d.variant.name for d in opt.DEPLOYS if opt.caches_prefixes(d.variant.config(base))}
    assert caching == {"disaggregated+prefix-caching", "disaggregated-2p+prefix-caching",
                       "disaggregated-2p+prefix-caching+least-loaded"}
    assert opt.caches_prefixes({"engine": {}, "pool_engines": {"decode": {"enable_prefix_caching": True}}})


def test_prefix_routing_rows_show_the_share_of_prompt_tokens_sent_to_their_cached_prefix():
    def step(hits: int | None) -> dict:
        return {"router_counts": {} if hits is None else {"prefix_hit_tokens": hits, "placements": {}}}

    parts = {"disaggregated-2p+prefix-caching+least-loaded": {
                 "steps": [dict(_summary(1.0), input_tok_s=100.0), dict(_summary(1.0), input_tok_s=100.0)],
                 "resources": {"chat": step(None), "multiturn": step(None)}},
             "disaggregated-2p+prefix-caching": {
                 "steps": [dict(_summary(0.5), input_tok_s=100.0), dict(_summary(0.9), input_tok_s=100.0)],
                 "resources": {"multiturn": step(600), "chat": step(0)}}}
    by = {d.variant.name: d for d in opt.DEPLOYS}
    metrics = {n: opt.step_metrics(p, by[n].workloads) for n, p in parts.items()}
    rows = {r["workload"]: r for r in opt.rows_of(metrics, {})}
    # 800 prompt tokens in the 8 s step, 600 of them sent where they were cached
    assert rows["multiturn"]["prefix_hits"] == {"base": None, "opt": 0.75}
    assert rows["chat"]["prefix_hits"]["opt"] == 0.0
    assert "routed to their cached prefix 75%" in opt.summary_table(list(rows.values()))


def test_a_bad_eval_prompt_count_is_refused_before_anything_starts(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        opt.main(["--eval-prompts", "0"])
    assert exc.value.code == 2 and "--eval-prompts 0 must be > 0" in capsys.readouterr().err


def test_negative_quiet_wait_or_retries_are_refused(capsys) -> None:
    for argv in (["--quiet-wait", "-1"], ["--retries", "-1"]):
        with pytest.raises(SystemExit) as exc:
            opt.main(argv)
        assert exc.value.code == 2 and "must be >= 0" in capsys.readouterr().err
