"""Policy registry, router config, latency model sources, and the router benchmark CLI."""

from __future__ import annotations

import pytest

from benchmarks.router import main as bench_main
from benchmarks.router import time_decisions
from cluster.config import ConfigError, RouterConfig, SLOConfig, parse_config
from cluster.router import DEFAULT_PROFILE, RouteRequest, latency_from_config, make_policy
from cluster.router.baselines import least_loaded
from cluster.router.goodput import GoodputPolicy
from engine.contract import WorkerStats


def test_make_policy_by_name_and_backwards_compatible_call() -> None:
    assert make_policy("least_loaded") is least_loaded
    assert make_policy("round_robin").__class__.__name__ == "RoundRobin"
    assert isinstance(make_policy("goodput"), GoodputPolicy)  # the old one-argument call still works
    with pytest.raises(ValueError, match="unknown router policy 'fast'; choose one of goodput, least_loaded, round_robin"):
        make_policy("fast")


def test_goodput_takes_its_settings_from_the_deploy_config() -> None:
    cfg = parse_config({"router": {"policy": "goodput", "admission": "best_effort", "prediction_sigma": 0.4,
                                   "admit_probability": 0.7, "ewma_alpha": 0.3},
                        "slo": {"ttft_ms": 800, "tpot_ms": 50}})
    p = make_policy(cfg.router.policy, router_cfg=cfg.router, slo=cfg.slo,
                    max_prefill_tokens=cfg.engine.max_num_batched_tokens)
    assert isinstance(p, GoodputPolicy)
    assert (p.sigma, p.admit_probability, p.alpha, p.record_refused) == (0.4, 0.7, 0.3, True)
    assert (p.default_ttft_s, p.default_tpot_s) == (0.8, 0.05)
    assert p.max_prefill_tokens == 4096  # engine.max_num_batched_tokens unset
    pools = cfg.pools
    full = make_policy("goodput", router_cfg=cfg.router, slo=cfg.slo, prefill_tp=pools.prefill_tp,
                       decode_tp=pools.decode_tp, max_prefill_tokens=2048)
    assert full.max_prefill_tokens == 2048
    # the baselines accept (and ignore) the same keyword arguments
    assert make_policy("least_loaded", router_cfg=cfg.router, slo=cfg.slo) is least_loaded


def test_latency_model_sources() -> None:
    assert DEFAULT_PROFILE.is_file()
    assert "SmolLM2" in latency_from_config(None).label
    rel = latency_from_config(RouterConfig(latency_profile="manifests/profiles/cpu-smollm2.yaml"))
    assert rel.terms == latency_from_config(RouterConfig()).terms
    gpu = latency_from_config(RouterConfig(latency_model="llama-3.1-8b", latency_hardware="h100-sxm", latency_tp=2))
    assert gpu.tp == 2 and "llama-3.1-8b" in gpu.label
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        latency_from_config(RouterConfig(latency_profile="nope.yaml"))
    per_pool = make_policy("goodput", router_cfg=RouterConfig(latency_model="llama-3.1-8b",
                                                              latency_hardware="h100-sxm"), prefill_tp=2, decode_tp=1)
    assert (per_pool.latency.tp, per_pool.decode_latency.tp) == (2, 1)


def test_router_config_validation_names_the_fields() -> None:
    cfg = RouterConfig()  # the defaults: goodput with admission, calibrated on the serving machine
    assert (cfg.policy, cfg.admission, cfg.latency_profile, cfg.calibrates()) == ("goodput", "queue", None, True)
    with pytest.raises(ConfigError, match="latency_model and latency_hardware"):
        parse_config({"router": {"latency_model": "llama-3.1-8b"}})
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"router": {"latency_model": "llama-3.1-8b", "latency_hardware": "h100-sxm",
                                 "latency_profile": "x.yaml"}})
    with pytest.raises(ConfigError, match="router.admit_probability"):
        parse_config({"router": {"admit_probability": 1.5}})


def test_policies_share_the_signature() -> None:
    s = [WorkerStats("w", "prefill", "", 0, 0, 0, 0, 0.0, 100, (), True, 0.0)]
    d = [WorkerStats("v", "decode", "", 0, 0, 0, 0, 0.0, 5760, (), True, 0.0)]
    for name in ("goodput", "least_loaded", "round_robin"):
        out = make_policy(name, slo=SLOConfig())(RouteRequest(10, 5, 2.0, 0.2), s, d)
        assert out.admit and (out.prefill, out.decode) == ("w", "v")


def test_benchmark_prints_the_table_and_decision_times(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--n", "150", "--rate", "1.0", "--calls", "200", "--workers", "16"]) == 0
    out = capsys.readouterr().out
    for word in ("goodput (best_effort)", "least_loaded", "round_robin", "attainment", "p50", "p99"):
        assert word in out
    t = time_decisions("goodput", latency_from_config(None), SLOConfig(), workers=64, calls=300)
    assert t.workers == 64 and 0 < t.p50_us < 2000  # NOTE: generous; the benchmark prints the real number
    with pytest.raises(SystemExit):
        bench_main(["--rate", "-1"])


def test_least_loaded_counts_the_prompts_a_decode_worker_is_pulling() -> None:
    """Prompts whose KV a decode worker pulls are not in its queued_prompt_tokens (nothing to prefill there),
    but they are context it will decode: least_loaded weighs them as load."""
    d0 = WorkerStats("d0", "decode", "", 1, 2, 1, 600, 0.2, 5760, (), True, 0.0, pulling=1, pulling_tokens=900)
    d1 = WorkerStats("d1", "decode", "", 1, 2, 300, 700, 0.2, 5760, (), True, 0.0)
    assert least_loaded(RouteRequest(100, 16, 2.0, 0.1), [], [d0, d1]).decode == "d1"
