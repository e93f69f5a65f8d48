"""CLI contracts: --json keys other tools parse, exit codes, error messages instead of tracebacks."""

from __future__ import annotations

import json

import pytest
import yaml

from placement.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_roofline_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "roofline", "--model", "llama-3.1-70b", "--hardware", "h200", "--gpus", "4",
                     "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--context", "8192", "--batch", "1,8,32",
                     "--gpu-hour-usd", "4", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["batch"] for r in rows] == [1, 8, 32]
    for r in rows:
        assert {"batch", "bytes_per_step", "tpot_s", "user_tok_s", "total_tok_s", "cost_per_m_usd"} <= set(r)
    # 70.6 GB of fp8 weights over 4 x 4.8 TB/s
    assert rows[0]["tpot_s"] == pytest.approx(rows[0]["bytes_per_step"] / (4 * 4.8e12), rel=1e-6)
    assert rows[0]["bytes_per_step"] < rows[2]["bytes_per_step"]
    assert rows[2]["total_tok_s"] > rows[0]["total_tok_s"] and rows[2]["cost_per_m_usd"] < rows[0]["cost_per_m_usd"]


@pytest.mark.parametrize("load", [["--concurrency", "8"], ["--rate", "4"]])
def test_predict_json(capsys: pytest.CaptureFixture[str], load: list[str]) -> None:
    rc, out, _ = run(capsys, "predict", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--weight-dtype", "bf16",
                     "--kv-dtype", "bf16", "--mode", "disaggregated", "--prefill-instances", "1", "--prefill-tp", "1",
                     "--decode-instances", "1", "--decode-tp", "2", "--isl", "1024", "--osl", "64", *load,
                     "--requests", "200", "--json")
    j = json.loads(out)
    assert rc == 0 and j["completed"] == 200
    for k in ("ttft_s", "tpot_s"):
        assert set(j[k]) == {"p50", "p90", "p99", "mean"} and 0 < j[k]["p50"] <= j[k]["p99"]
    assert j["throughput_tok_s"] > 0 and j["requests_per_s"] > 0


def test_predict_colocated_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "predict", "--mode", "colocated", "--instances", "2", "--tp", "1", "--isl", "512",
                     "--osl", "32", "--concurrency", "4", "--requests", "100")
    assert rc == 0 and "TTFT p50/p90/p99" in out


def test_plan_json_and_errors(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    cfg = {"model": {"name": "llama-3.1-8b"}, "hardware": {"name": "h100-sxm"}, "cluster": {"nodes": 1},
           "workload": {"rate_rps": 10, "input": {"kind": "fixed", "value": 1024},
                        "output": {"kind": "fixed", "value": 128}},
           "slo": {"ttft_s": 0.5, "tpot_s": 0.05}, "search": {"tp_options": [1], "max_pp": 1, "requests": 100}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, _ = run(capsys, "plan", str(path), "--json")
    j = json.loads(out)
    assert rc == 0 and j["prefill"] == {"instances": j["prefill"]["instances"], "tp": 1, "pp": 1}
    assert j["gpus"] <= 8 and j["goodput_rps"] >= 10 and j["colocated"]["gpus"] == j["gpus"]
    cfg["workload"]["rate_rps"] = -1
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = run(capsys, "plan", str(path))
    assert rc == 2 and "workload.rate_rps" in err and "greater than 0" in err and not out
    rc, _, err = run(capsys, "plan", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "does not exist" in err
