"""Quantized weights in the planner: the dtype an engine's quantization implies, and what it changes in
the catalog roofline (weight bytes, the tensor-core peak the GEMMs run at)."""

from __future__ import annotations

import json

import pytest

from placement.catalog import get_hardware, get_model, weight_dtype_of
from placement.latency import LatencyModel


def _group(kind: str, bits: int, acts: bool) -> dict:
    g = {"weights": {"type": kind, "num_bits": bits}}
    if acts:
        g["input_activations"] = {"type": kind, "num_bits": bits}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": g}}


@pytest.mark.parametrize(("quantization", "config", "dtype"), [
    ("fp8", None, "fp8"), ("awq", None, "int4"), ("modelopt_fp4", None, "fp4"),
    (None, _group("int", 8, True), "int8"),       # W8A8: engine/quantize.py writes this
    (None, _group("int", 8, False), None),        # W8A16: no planner dtype for int8 weights on 16-bit GEMMs
    (None, _group("int", 4, False), "int4"), (None, _group("float", 8, True), "fp8"),
    (None, {"quant_method": "gptq"}, "int4"), (None, None, None), ("bitsandbytes", None, None),
])
def test_the_dtype_an_engines_quantization_implies(quantization, config, dtype) -> None:
    assert weight_dtype_of(quantization, config) == dtype


def test_int8_weights_halve_the_decode_weight_stream_and_use_the_int8_peak() -> None:
    def lat(dtype: str, hw: str = "h100-sxm") -> LatencyModel:
        return LatencyModel.from_catalog(get_model("llama-3.1-8b"), get_hardware(hw), weight_dtype=dtype)

    bf16, int8, int4 = lat("bf16"), lat("int8"), lat("int4")
    # a small decode batch streams the weights (plus fixed per-step costs): int8 halves the stream, 4-bit
    # (with its group scales) nearly halves it again; int8 costs what fp8 does (same bytes, same peak on H100)
    assert int8.decode_step_time_s(1, 512) < 0.75 * bf16.decode_step_time_s(1, 512)
    assert int4.decode_step_time_s(1, 512) < 0.85 * int8.decode_step_time_s(1, 512)
    assert int8.decode_step_time_s(8, 4096) == pytest.approx(lat("fp8").decode_step_time_s(8, 4096))
    # a long prompt is compute-bound: int8 runs on the INT8 tensor cores (2x bf16 on H100), int4 on bf16's
    assert int8.prefill_time_s([8192]) < 0.75 * bf16.prefill_time_s([8192])
    assert int4.prefill_time_s([8192]) == pytest.approx(bf16.prefill_time_s([8192]), rel=0.1)
    # no INT8 entry (B300): int8 GEMMs planned at the 16-bit peak
    assert get_hardware("b300").compute_dtype("int8") == "bf16"


def test_the_deploy_time_planner_plans_the_weights_the_engines_run(tmp_path) -> None:
    from cluster.config import ConfigError
    from cluster.control.planning import plan_for
    from tests.unit.test_deploy_config import _auto_deploy

    # the planner section leaves the dtypes out: taken from the engines, and the plan says so
    cfg = _auto_deploy(tmp_path / "a", None, None, planner_extra={"model": {"name": "smollm2-135m"}},
                       engine={"model": "smollm2", "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"})
    _, text = plan_for(cfg)
    assert "planner.model.weight_dtype: fp8, from engine.quantization=fp8" in text
    assert "planner.model.kv_dtype: fp8, from engine.kv_cache_dtype=fp8_e4m3" in text
    # set and different: an error naming both
    with pytest.raises(ConfigError, match="planner.model.weight_dtype=fp32 but the engines run fp8"):
        plan_for(_auto_deploy(tmp_path / "b", None, None, engine={"model": "smollm2", "quantization": "fp8"}))
    # a local checkpoint's own quantization config (what engine/quantize.py writes for the W8A8 copy)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": _group("int", 8, True)}))
    cfg = _auto_deploy(tmp_path / "c", None, None, planner_extra={"model": {"name": "smollm2-135m"}},
                       engine={"model": str(ckpt)})
    assert f"planner.model.weight_dtype: int8, from the quantization_config of {ckpt}/config.json" in plan_for(cfg)[1]
