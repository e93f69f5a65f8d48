"""vLLM's own benchmark client, `vllm bench serve`, against our endpoint on both of its OpenAI backends,
beside benchmarks.serve on the same workload (benchmarks/vllm_bench.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_vllm_bench_serve_runs_against_our_endpoint_on_both_backends(endpoint, model_name):
    from benchmarks.vllm_bench import FIELDS, compare, table
    from engine.models import resolve_model

    result = compare(endpoint, str(resolve_model("smollm2")), backends=["openai", "openai-chat"], input_len=64,
                     output_len=8, num_prompts=6, rate=2.0, model=model_name)
    print("\n" + table(result))
    for backend, row in result["rows"].items():
        v, o = row["vllm_bench"], row["benchmarks_serve"]
        assert (v["completed"], v["failed"]) == (6, 0), (backend, v)  # every request answered: no 400s
        assert (o["completed"], o["failed"]) == (6, 0), (backend, o)
        assert v["total_output_tokens"] == o["total_output_tokens"] == 6 * 8  # ignore_eos honoured
        # NOTE: the two clients measure the same server one after the other on a shared 2-core box: their
        # medians must agree to within a factor (the committed run shows how close on a quiet box).
        for k in FIELDS[:1] + FIELDS[2:3]:
            assert 0.5 < row["ratio"][k] < 2.0, (backend, k, row)
