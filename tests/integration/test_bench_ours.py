"""Issue 7: the same benchmark tool, unchanged, against our own endpoint (the session deployment)."""

from __future__ import annotations

import re

import httpx
import pytest

from benchmarks.serve import run_benchmark
from benchmarks.stats import SLO
from benchmarks.workload import ChatWorkload

pytestmark = pytest.mark.integration


def _tokens(endpoint: str) -> dict[str, float]:
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    out = {}
    for k in ("input", "output"):
        # NOTE: a labelled counter has no sample until its first request: absent means 0.
        m = re.search(rf'^saaf_tokens_total\{{kind="{k}"\}} ([0-9.e+]+)$', text, re.M)
        out[k] = float(m.group(1)) if m else 0.0
    return out


def test_benchmark_against_our_endpoint(endpoint, model_name):
    before = _tokens(endpoint)
    result = run_benchmark(endpoint, model_name, ChatWorkload(32, 0.5, 12, 0.5), [2.0], num_requests=8,
                           slo=SLO(ttft_s=10.0, tpot_s=1.0), max_total_len=1024, warmup_requests=0,
                           request_timeout_s=180.0)
    after = _tokens(endpoint)
    s, records = result.steps[0].summary, result.steps[0].records
    assert (s.sent, s.succeeded, s.rejected_429, s.errors) == (8, 8, 0, {})
    for r in records:
        assert r.ok and r.usage_reported and r.ttft_s and r.ttft_s > 0
        assert r.completion_tokens == r.output_len  # ignore_eos honoured: exactly max_tokens
        assert len(r.itl_s) == r.chunks - 1
    # What the client counted is what our ingress counted.
    assert after["input"] - before["input"] == sum(r.prompt_tokens for r in records)
    assert after["output"] - before["output"] == sum(r.completion_tokens for r in records)
    assert 0 < s.ttft.p50 <= s.ttft.p90 <= s.ttft.p99
