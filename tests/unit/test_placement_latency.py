"""Latency model: DistServe regression, TP scaling, roofline, KV arithmetic, profile round trip."""

from __future__ import annotations

import time

import pytest

from placement import (
    Coefficients,
    LatencyModel,
    LatencySpec,
    ProfileData,
    get_hardware,
    get_model,
    model_from_hf_config,
    save_profile,
)
from placement.errors import UnknownNameError

OPT13B = Coefficients(prefill_a=0.0948, prefill_b=4.03e-6, prefill_c=18.89, decode_a=6.11e-4, decode_b=0.0682,
                      decode_c=19.88)


def _opt(tp: int, pp: int = 1) -> LatencyModel:
    return LatencyModel.from_catalog(get_model("opt-13b"), get_hardware("a100-80gb"), tp=tp, pp=pp,
                                     weight_dtype="fp16", kv_dtype="fp16", spec=LatencySpec(coefficients={1: OPT13B}))


def test_regression_tp1_matches_distserve_formula() -> None:
    lat = _opt(1)
    assert lat.prefill_time_s([512]) == pytest.approx((0.0948 * 512 + 4.03e-6 * 512**2 + 18.89) / 1e3)
    assert lat.prefill_time_s([100, 300]) == pytest.approx((0.0948 * 400 + 4.03e-6 * (100**2 + 300**2) + 18.89) / 1e3)
    assert lat.decode_step_time_s(32, 32 * 800) == pytest.approx((6.11e-4 * 25600 + 0.0682 * 32 + 19.88) / 1e3)
    assert lat.decode_step_time_s(0, 0) == 0.0


def test_tensor_parallel_is_faster_but_sublinear() -> None:
    t1, t2, t4 = (_opt(tp).prefill_time_s([1024]) for tp in (1, 2, 4))
    assert t4 < t2 < t1
    assert t1 / t2 < 2.0 and t1 / t4 < 4.0
    d1, d2 = _opt(1).decode_step_time_s(64, 64 * 900), _opt(2).decode_step_time_s(64, 64 * 900)
    assert d2 < d1 < 2 * d2


def test_kv_arithmetic() -> None:
    llama = get_model("llama-3.1-8b")
    assert llama.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2
    assert llama.kv_bytes_per_token("fp8") == 2 * 32 * 8 * 128
    lat = _opt(1)
    assert lat.kv_bytes_per_token() == 2 * 40 * 5120 * 2
    # 80 GiB * 0.9 - 2 GiB reserve - 25.7 GB of fp16 weights, in 819,200-byte tokens
    assert 55_000 < lat.kv_capacity_tokens() < 66_000
    assert _opt(2).kv_capacity_tokens() > 2 * lat.kv_capacity_tokens()
    assert lat.kv_transfer_time_s(1000, same_node=True) < lat.kv_transfer_time_s(1000, same_node=False)
    nic = lat.kv_transfer_time_s(2000, False) - lat.kv_transfer_time_s(1000, False)
    assert nic == pytest.approx(1000 * 819_200 / (25e9 * 0.8))


def test_roofline_decode_is_memory_bound_at_small_batch() -> None:
    m, h = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    lat = LatencyModel.from_catalog(m, h, tp=1, spec=LatencySpec(step_overhead_ms=0.0))
    ideal = m.weight_bytes("bf16") / (3.35e12 * 0.85)
    assert lat.decode_step_time_s(1, 100) == pytest.approx(ideal, rel=0.02)
    # prefill of a long prompt is compute bound: ~2 * params FLOPs per token
    t = lat.prefill_time_s([8192])
    assert t > 2 * 7e9 * 8192 / (989e12 * 0.6)
    fp8 = LatencyModel.from_catalog(m, h, tp=1, weight_dtype="fp8", kv_dtype="fp8",
                                     spec=LatencySpec(step_overhead_ms=0.0))
    assert fp8.decode_step_time_s(1, 100) < lat.decode_step_time_s(1, 100)
    assert fp8.kv_capacity_tokens() > lat.kv_capacity_tokens()


def test_roofline_gemms_and_attention_add_up() -> None:
    """The weights' pass and the KV cache's pass are separate kernels: a decode step with a long context pays
    both; a prompt token costs the layers' FLOPs (no LM head) and its attention runs at the 16-bit peak."""
    m, h = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    spec = LatencySpec(step_overhead_ms=0.0, compute_efficiency=1.0, memory_efficiency=1.0)
    lat = LatencyModel.from_catalog(m, h, tp=1, weight_dtype="fp8", kv_dtype="fp8", spec=spec)
    hbm = 3.35e12
    weights, kv = m.weight_bytes("fp8") / hbm, 32 * 100_000 * m.kv_bytes_per_token("fp8") / hbm
    assert lat.decode_step_time_s(32, 32 * 100_000) == pytest.approx(weights + kv, rel=1e-3)
    assert m.linear_flops_per_token() - m.layer_flops_per_token() == 2 * m.vocab * m.hidden
    gemm = 8192 * m.layer_flops_per_token() / 1979e12
    attn = m.attention_flops(8192**2) / 989e12
    assert lat.prefill_time_s([8192]) == pytest.approx(gemm + attn, rel=1e-3)
    tied = get_model("smollm2-135m")  # the head is the embedding: counted once in params, computed per token
    assert tied.layer_flops_per_token() == pytest.approx(2 * (tied.params - tied.vocab * tied.hidden))


def test_prefix_hits_cut_prefill_compute_not_fixed_costs_or_decode() -> None:
    m, h = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    lat = LatencyModel.from_catalog(m, h, tp=1, spec=LatencySpec(ttft_overhead_ms=30.0))
    hit = lat.with_prefix_hits(0.5)
    fixed = lat.terms.p_fixed
    # a 4096-token prompt with half of it cached costs what its 2048 new tokens cost, attending to all 4096
    assert hit.prefill_time_s([4096]) - fixed == pytest.approx(
        lat.terms.pa * 2048 + lat.terms.pb * (4096**2 - 2048**2), rel=1e-9)
    assert hit.decode_step_time_s(8, 8000) == lat.decode_step_time_s(8, 8000)
    assert hit.request_overhead(4096) == lat.request_overhead(4096)
    assert lat.with_prefix_hits(0.0) is lat


def test_calls_are_cheap() -> None:
    lat = _opt(2)
    t0 = time.perf_counter()
    for i in range(20_000):
        lat.prefill_time_s([512])
        lat.decode_step_time_s(32, 20_000 + i)
        lat.kv_transfer_time_s(512, True)
    per_call = (time.perf_counter() - t0) / 60_000
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} us per call"


def test_unknown_names_list_supported() -> None:
    with pytest.raises(UnknownNameError, match="llama-3.1-8b"):
        get_model("gpt-5")
    with pytest.raises(UnknownNameError, match="h100-sxm"):
        get_hardware("tpu-v9")


def test_hf_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,'
        ' "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": true, "hidden_act": "silu",'
        ' "max_position_embeddings": 8192}')
    m = model_from_hf_config(tmp_path)
    assert (m.layers, m.kv_heads, m.head_dim) == (30, 3, 64)
    assert abs(m.params - 134.5e6) / 134.5e6 < 0.02
    assert get_model(str(tmp_path / "config.json")).params == m.params


def test_profile_round_trip(tmp_path) -> None:
    prof = ProfileData.model_validate({
        "created": "2025-01-01T00:00:00+00:00",
        "machine": {"hostname": "h", "platform": "p", "cpu_count": 2, "python": "3.11"},
        "model": {"spec": "x", "path": "/x", "name": "x", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4,
                  "head_dim": 16, "params": 1000},
        "engine": {"dtype": "float32", "block_size": 128, "kv_cache_mib": 64, "max_model_len": 512},
        "coefficients": OPT13B.model_dump(),
        "fit": {"prefill_r2": 0.99, "decode_r2": 0.98, "prefill_samples": [], "decode_samples": []},
        "kv_bytes_per_token": 1024, "kv_capacity_tokens": 5000,
    })
    path = save_profile(prof, tmp_path / "p.yaml")
    assert not list(tmp_path.glob(".*.tmp"))
    lat = LatencyModel.from_profile(path)
    assert lat.kv_capacity_tokens() == 5000 and lat.kv_bytes_per_token() == 1024
    assert lat.prefill_time_s([512]) == pytest.approx(_opt(1).prefill_time_s([512]))


def test_unmeasured_tps_derive_from_the_nearest_measured_one_below() -> None:
    """Coefficients for TP2 and TP4 only (a model too large for one GPU): TP2/TP4 are used as given, TP8 scales
    from TP4 (not TP1), TP1 from TP2; an empty table is a clear config error."""
    from placement import Coefficients, LatencySpec
    from placement.config import parse_planner_config
    from placement.errors import PlacementError

    c2 = Coefficients(prefill_a=0.09, prefill_b=8e-6, prefill_c=29.0, decode_a=3e-4, decode_b=0.087, decode_c=26.0)
    c4 = Coefficients(prefill_a=0.05, prefill_b=4e-7, prefill_c=32.0, decode_a=1.8e-4, decode_b=0.055, decode_c=28.0)
    spec = LatencySpec(coefficients={2: c2, 4: c4}, tp_efficiency=0.8)

    def lat(tp: int) -> LatencyModel:
        return LatencyModel.from_catalog(get_model("opt-13b"), get_hardware("a100-80gb"), tp=tp,
                                         weight_dtype="fp16", kv_dtype="fp16", spec=spec)

    n = 1000
    t2, t4, t8, t1 = (lat(k).prefill_time_s([n]) for k in (2, 4, 8, 1))
    assert t2 == pytest.approx((c2.prefill_c + c2.prefill_a * n + c2.prefill_b * n * n) / 1e3)
    assert t4 == pytest.approx((c4.prefill_c + c4.prefill_a * n + c4.prefill_b * n * n) / 1e3)
    per_token_8 = (lat(8).prefill_time_s([2 * n]) - t8) / n
    assert per_token_8 == pytest.approx(c4.prefill_a / 1e3 / (2 * 0.8), rel=0.15)  # from TP4, all-reduce added
    assert t1 > t2
    with pytest.raises(PlacementError, match="at least one entry"):
        parse_planner_config({"model": {"name": "opt-13b"}, "hardware": {"name": "a100-80gb"},
                              "workload": {"rate_rps": 1, "input": {"kind": "fixed", "value": 10},
                                           "output": {"kind": "fixed", "value": 10}},
                              "slo": {"ttft_s": 1, "tpot_s": 0.1}, "latency": {"coefficients": {}}})
