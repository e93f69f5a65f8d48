"""The benchmark tool, unchanged, against vLLM's own OpenAI server (tiny random Llama on CPU).

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with a free port, runs a small
benchmark and the greedy-quality check against it, and stops the server by PID.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.report import write_report
from benchmarks.serve import run_benchmark
from benchmarks.stats import SLO
from benchmarks.workload import ChatWorkload

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 300.0
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    from engine.models import resolve_model, served_name
    from tests.helpers.vllm_server import ServerFailed
    from tests.helpers.vllm_server import vllm_server as server

    model_dir, name = resolve_model("tiny-llama"), served_name("tiny-llama")
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    try:
        with server(model_dir, name, log_path, max_model_len=MAX_MODEL_LEN, kv_cache_mib=64) as url:
            yield url, name
    except ServerFailed as e:
        pytest.fail(str(e))


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out = {}
    for metric in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        values = re.findall(rf"^{re.escape(metric)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
        out[metric] = sum(float(v) for v in values)
    return out


def test_benchmark_against_vllm_server(vllm_server: tuple[str, str], tmp_path: Path) -> None:
    url, model = vllm_server
    before = _counters(url)
    result = run_benchmark(url, model, ChatWorkload(32, 0.5, 16, 0.5), [4.0], num_requests=8,
                           slo=SLO(ttft_s=5.0, tpot_s=1.0), max_total_len=MAX_MODEL_LEN, warmup_requests=0,
                           request_timeout_s=120.0)
    after = _counters(url)
    step = result.steps[0]
    s, records = step.summary, step.records
    print(json.dumps(s.to_dict(), indent=1))
    assert (s.sent, s.succeeded, s.rejected_429, s.errors) == (8, 8, 0, {})
    for r in records:
        assert r.ok and r.usage_reported and r.ttft_s is not None and r.ttft_s > 0
        assert r.completion_tokens == r.output_len  # ignore_eos: exactly max_tokens
        assert r.prompt_tokens == r.input_len  # one word per token with SmolLM2's tokenizer
        assert len(r.itl_s) == r.chunks - 1 and 1 <= r.chunks <= r.completion_tokens
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    # the client's usage totals agree with the server's own Prometheus counters
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == sum(r.prompt_tokens for r in records)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == sum(
        r.completion_tokens for r in records)
    assert s.ttft.count == 8 and s.itl.count == sum(len(r.itl_s) for r in records) > 0
    for summary in (s.ttft, s.itl, s.tpot, s.e2e):
        assert summary.p50 is not None and 0 < summary.p50 <= summary.p90 <= summary.p99 <= summary.max
    assert s.attainment == pytest.approx(s.slo_met / 8)
    paths = write_report(result, tmp_path)
    assert all(p.is_file() for p in paths)
    assert json.loads((tmp_path / "report.json").read_text())["steps"][0]["summary"]["succeeded"] == 8


def test_chat_route_against_vllm_server(vllm_server: tuple[str, str]) -> None:
    url, model = vllm_server
    result = run_benchmark(url, model, ChatWorkload(16, 0.3, 8, 0.3), [8.0], num_requests=4, api="chat",
                           max_total_len=MAX_MODEL_LEN, request_timeout_s=120.0)
    s = result.steps[0].summary
    assert (s.sent, s.succeeded) == (4, 4)
    assert all(r.completion_tokens == r.output_len and r.prompt_tokens > r.input_len for r in result.steps[0].records)


def test_greedy_quality_endpoint_vs_offline(vllm_server: tuple[str, str], tmp_path: Path) -> None:
    url, model = vllm_server
    out = tmp_path / "quality.json"
    cmd = [sys.executable, "-m", "benchmarks.quality", "--endpoint", url, "--model", model,
           "--offline-model-dir", "tiny-llama", "--max-model-len", str(MAX_MODEL_LEN), "--out", str(out)]
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (comparison,) = data["comparisons"]
    assert comparison["exact_match_rate"] == 1.0
    assert all(row["unit"] == "token" for row in comparison["prompts"])
    assert len(data["sources"]["offline"]) == 20
