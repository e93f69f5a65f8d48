"""Prediction validation: parsing measured rows, the held-out split, MAPE tables, the fit, calibration."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from placement import LatencySpec, PlacementError, fitting
from placement.calibration import calibrated_spec, fitted
from placement.fitting import fit_group, spec_of
from placement.validation import Prediction, ServingPoint, error_table, load_points, predict_point
from placement.validation_report import Report, write_calibration, write_report

HEADER = ("id,silicon_data_source,backend,backend_version,model_path,system,precision,mode,isl,osl,gemm_quant_mode,"
          "moe_quant_mode,batch_size,tp_size,pp_size,attention_dp_size,moe_tp_size,moe_ep_size,prefill_batch_size,"
          "prefill_num_workers,prefill_tp_size,prefill_pp_size,prefill_attention_dp_size,prefill_moe_tp_size,"
          "prefill_moe_ep_size,decode_batch_size,decode_num_workers,decode_tp_size,decode_pp_size,"
          "decode_attention_dp_size,decode_moe_tp_size,decode_moe_ep_size,silicon_ttft_ms,silicon_tpot_ms")
# Rows in the layout of aiconfigurator's silicon validation set (values made up for the test).
ROWS = [
    "a,src,vllm,0.19,meta-llama/Llama-3.1-70B,b200_sxm,fp4,agg,1024,1024,nvfp4,nvfp4,16,2,1,1,1,1,,,,,,,,,,,,,,,134,10.7",
    "b,src,trtllm,1.0,Qwen/Qwen3-32B,h100_sxm,,agg,4000,1000,,,24,1,1,,1,0,,,,,,,,,,,,,,,295,16.9",
    "c,src,vllm,0.12,Qwen/Qwen3-32B,h100_sxm,fp8,disagg,4000,1000,fp8,fp8,,,,,,,1,8,1,1,1,0,0,224,2,4,1,1,0,0,368,8.7",
    "d,src,sglang,0.5,deepseek-ai/DeepSeek-R1,h200_sxm,fp8,agg,1024,1024,fp8,fp8,64,8,1,1,8,1,,,,,,,,,,,,,,,500,20",
    "e,src,trtllm,1.0,meta-llama/Llama-3.1-70B,b200_sxm,int4,agg,1024,1024,int4_wo,int4_wo,8,1,1,1,1,1,,,,,,,,,,,,,,,90,13",
    "f,src,trtllm,1.0,meta-llama/Llama-3.1-70B,b200_sxm,fp8,agg,1024,1024,fp8,fp8,8,4,1,4,1,1,,,,,,,,,,,,,,,90,13",
]


def csv_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.csv"
    path.write_text("\n".join([HEADER, *ROWS]) + "\n")
    return path


def test_rows_parse_or_say_why_not(tmp_path: Path) -> None:
    points, skipped = load_points(csv_file(tmp_path))
    by_id = {p.id: p for p in points}
    assert set(by_id) == {"a", "b", "c"}
    a = by_id["a"]
    assert (a.model, a.hardware, a.weight_dtype, a.kv_dtype, a.mode, a.tp, a.concurrency) == (
        "llama-3.1-70b", "b200", "fp4", "fp8", "colocated", 2, 16)
    assert by_id["b"].weight_dtype == "bf16" and by_id["b"].kv_dtype == "bf16"
    c = by_id["c"]
    assert (c.mode, c.prefill_instances, c.prefill_tp, c.decode_instances, c.decode_tp, c.concurrency) == (
        "disaggregated", 8, 1, 2, 4, 448)
    assert sum(skipped.values()) == 3
    assert any("MoE" in k for k in skipped) and any("int4" in k for k in skipped)
    assert any("attention data parallelism" in k for k in skipped)
    with pytest.raises(PlacementError, match="do not exist"):
        load_points(tmp_path / "missing.csv")


def test_held_out_split_is_by_series_and_deterministic(tmp_path: Path) -> None:
    (a, *_), _ = load_points(csv_file(tmp_path))
    twin = a._replace(id="a2", concurrency=64, ttft_ms=200.0)
    assert twin.series == a.series and twin.held_out == a.held_out  # a sweep stays on one side
    other = a._replace(isl=8192)
    assert other.series != a.series
    flags = {a._replace(osl=n).held_out for n in range(100, 160)}
    assert flags == {True, False}  # both sides occur


def test_error_table_mape() -> None:
    p = ServingPoint("x", "vllm", "llama-3.1-8b", "h200", "fp8", "fp8", "colocated", 1000, 100, 8, 1, 0, 0, 0, 0,
                     100.0, 10.0)
    rows = error_table([Prediction(p, 120.0, 9.0), Prediction(p._replace(id="y"), 90.0, 10.0),
                        Prediction(p._replace(id="z"), math.nan, math.nan, "does not fit")])
    (row,) = rows
    assert row.points == 3 and row.failed == 1
    assert row.ttft_mape == pytest.approx(15.0) and row.tpot_mape == pytest.approx(5.0)
    big = p._replace(id="w", model="llama-3.1-70b")
    preds = [Prediction(p, 120.0, 9.0), Prediction(big, 150.0, 10.0)]
    assert [r.label for r in error_table(preds)] == ["Llama-3.1-70B", "Llama-3.1-8B"]
    (pooled,) = error_table(preds, key="engine")
    assert pooled.points == 2 and pooled.ttft_mape == pytest.approx(35.0) and pooled.tpot_mape == pytest.approx(5.0)


def test_fit_recovers_a_known_engine(tmp_path: Path) -> None:
    truth = {"compute_efficiency": 0.4, "memory_efficiency": 0.6, "layer_overhead_us": 30.0, "ttft_overhead_ms": 60.0,
             "ttft_overhead_us_per_stream": 3000.0}
    base = ServingPoint("p", "vllm", "llama-3.1-8b", "h200", "fp8", "fp8", "colocated", 2000, 200, 8, 1, 0, 0, 0, 0,
                        1.0, 1.0)
    pts = []
    for i, (isl, c) in enumerate([(2000, 8), (500, 32), (8000, 4), (500, 4)]):
        p = base._replace(id=f"p{i}", isl=isl, concurrency=c)
        pr = predict_point(p, spec_of(truth), requests=2 * c)
        pts.append(p._replace(ttft_ms=pr.ttft_ms, tpot_ms=pr.tpot_ms))
    params, loss = fit_group(pts)
    start = fitting.loss(pts, {k: v for k, v in fitting.START.items() if k not in fitting.TP_ONLY})
    assert loss < 0.15 and loss < start / 3, (loss, start, params)  # ~5% per figure from ~20-60%
    assert fit_group(pts) == (params, loss)  # deterministic: same input, same answer
    rep = Report({"vllm/h200/fp8": params, "vllm/*/*": params}, {"vllm/h200/fp8": loss},
                 [predict_point(p, spec_of({k: v for k, v in params.items() if k != "step_overhead_ms"}))
                  for p in pts], Counter({"x: not modelled": 2}), 5,
                 {"date": "d", "git_commit": "c", "cpu": "cpu", "command": "python -m placement validate"})
    out = write_report(rep, tmp_path / "out")
    text = (out / "README.md").read_text()
    assert "python -m placement validate" in text and "| vllm | Llama-3.1-8B |" in text
    assert (out / "results.json").read_text().count('"id"') == 4
    assert "| vllm | every model |" in text
    mod = tmp_path / "cal.py"
    write_calibration(rep, mod)
    ns: dict[str, object] = {}
    exec(compile(mod.read_text(), str(mod), "exec"), ns)  # noqa: S102 - our own generated module
    assert ns["FITTED"] == rep.fitted


def test_calibration_fills_only_unset_fields() -> None:
    spec = calibrated_spec(LatencySpec(calibration="vllm", memory_efficiency=0.99), "b200", "fp4")
    got = fitted("vllm", "b200", "fp4")
    assert got, "vllm on b200 with NVFP4 weights is calibrated"
    assert spec.memory_efficiency == 0.99  # set by the user: kept
    assert spec.compute_efficiency == got["compute_efficiency"] and spec.calibration is None
    assert fitted("vllm", "a100-80gb", "bf16") == fitted("vllm", "no-such-gpu", "bf16")  # engine-wide fallback
    with pytest.raises(PlacementError, match="supported"):
        fitted("tgi", "b200", "fp8")
