"""The contract of our OpenAI surface: the same answers as vLLM's own server.

vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, same model and settings, greedy
or seeded, one colocated engine) and our disaggregated deployment answer a table of requests (each feature,
streamed and not) and lm-eval's tasks side by side (greedy answers do not depend on the load; each system
mostly runs one request on one core at a time, so on two cores the two recordings overlap instead of adding
up), and the two are compared field by field except ids, timestamps and `system_fingerprint`, with logprob
floats within LOGPROB_TOL. The file sorts first so that the session's deployment starts while vLLM's
server does.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.report import write_report
from benchmarks.serve import run_benchmark
from benchmarks.stats import SLO
from benchmarks.taskeval import run_taskeval
from benchmarks.workload import ChatWorkload
from tests.helpers.parity_table import CHAT, CMPL, RESP, TABLE, TOOL_ARGS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LOGPROB_TOL = 2e-3  # absolute, on log-probabilities (fp32 CPU kernels batch differently in the two systems)
# NOTE: `saaf_served` is ours on purpose: how each completion was served, in a stream's final usage chunk
# (cluster/serve/served.py); vLLM's server has no such field
DROP = {"id", "created", "created_at", "system_fingerprint", "call_id", "item_id", "response_id", "saaf_served"}


def _send(url: str, name: str, path: str, body: dict | None, stream: bool) -> Any:
    if body is None:  # a GET
        r = httpx.get(f"{url}{path}", timeout=120)
        return {"status": r.status_code, "body": r.json()}
    stream = stream or bool(body.get("stream"))
    body = dict(body, stream=True) if stream else body
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, timeout=180)
        return {"status": r.status_code, "body": r.json()}
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=180) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(r.read())}
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return {"status": 200, "events": _by_choice(events) if path in (CHAT, CMPL) else _responses(events)}


def _fold(acc: Any, new: Any) -> Any:
    """Stream deltas folded into one value: strings and lists concatenate, dicts merge key by key, list items
    with an "index" (tool calls) merge by index, other values keep the last one that is not None."""
    if acc is None:
        return new
    if isinstance(acc, dict) and isinstance(new, dict):
        return {**acc, **{k: _fold(acc.get(k), v) for k, v in new.items()}}
    if isinstance(acc, str) and isinstance(new, str):
        return acc + new
    if isinstance(acc, list) and isinstance(new, list):
        if all(isinstance(x, dict) and "index" in x for x in acc + new):
            merged = {x["index"]: x for x in acc}
            for x in new:
                merged[x["index"]] = _fold(merged.get(x["index"]), x)
            return [merged[i] for i in sorted(merged)]
        return acc + new
    return acc if new is None else new


def _by_choice(events: list) -> dict:
    """A stream as what it delivered per choice (text, logprobs, tool calls, finish reason, usage): how the
    tokens split into chunks depends on timing (vLLM merges outputs a slow reader has not taken yet)."""
    out: dict[str, Any] = {"other": [], "usage_on_every_chunk": None}
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    if chunks and any("usage" in e for e in chunks):
        out["usage_on_every_chunk"] = all(e.get("usage") for e in chunks)
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            for c in e["choices"]:
                key = f"choice{c['index']}"
                out[key] = _fold(out.get(key), {k: v for k, v in e.items() if k not in ("choices", "usage")} | c)
        else:
            out["other"].append(e)
    return out


def _responses(events: list) -> dict:
    """A Responses API stream as its final response, the text of its deltas and the kinds of events."""
    done = [e for e in events if isinstance(e, dict) and e.get("type") == "response.completed"]
    return {"completed": done[-1] if done else None, "types": sorted({e.get("type") for e in events
                                                                       if isinstance(e, dict)}),
            "text": "".join(e.get("delta", "") for e in events if isinstance(e, dict)
                            and e.get("type") == "response.output_text.delta")}


def record(url: str) -> dict[str, Any]:
    answers = {}
    for name, path, body, streams in TABLE:
        for stream in ((False, True) if streams else (False,)):
            answers[f"{name}{' (stream)' if stream else ''}"] = _send(url, name, path, body, stream)
    return answers


def _diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in DROP:
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'vLLM' if k in a else 'ours'}")
            else:
                _diff(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items in vLLM's, {len(b)} in ours")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{where}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float | int) and "logprob" in where:
        if not (math.isclose(a, b, abs_tol=LOGPROB_TOL) or (math.isinf(a) and a == b)):
            out.append(f"{where}: {a} vs {b}")
    elif a != b:
        out.append(f"{where}: vLLM {str(a)[:120]!r} vs ours {str(b)[:120]!r}")


def _ours(request) -> Callable[[], tuple[str, str]]:
    """A wait for our endpoint and model name: the session's deployment once it is up, or the developer's
    (conftest's DEV_ENDPOINT: no deployment of ours)."""
    if os.environ.get("SAAF_TEST_ENDPOINT"):
        fixed = os.environ["SAAF_TEST_ENDPOINT"], os.environ.get("SAAF_TEST_MODEL", "SmolLM2-135M-Instruct")
        return lambda: fixed
    started = request.getfixturevalue("deployment_started")  # NOTE: here: pytest's fixtures are not thread-safe

    def wait() -> tuple[str, str]:
        info = started.result(timeout=900)
        return info["endpoint"], info["model"]
    return wait


def _record_ours(where: Callable[[], tuple[str, str]], tokenizer_dir: str, tmp: Any) -> dict[str, Any]:
    url, model = where()
    return {"answers": record(url), "lmeval": run_taskeval(url, model, tokenizer_dir, tmp)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request) -> dict[str, Any]:
    """vLLM serve's answers to the table, its lm-eval scores and the benchmark tools' runs against it; and,
    recorded meanwhile in a thread, our deployment's answers and scores (a Future: its failure fails only
    the tests that compare with ours)."""
    from engine.models import resolve_model, served_name
    from tests.helpers.vllm_server import ServerFailed, vllm_server

    tmp = tmp_path_factory.mktemp("vllm-ref")
    model_dir = resolve_model("smollm2")
    pool = ThreadPoolExecutor(1, thread_name_prefix="parity-ours")
    ours = pool.submit(_record_ours, _ours(request), model_dir, tmp_path_factory.mktemp("ours"))
    try:
        with vllm_server(model_dir, served_name("smollm2"), tmp / "server.log", max_model_len=1024,
                         extra=TOOL_ARGS) as url:
            return {"answers": record(url), "lmeval": run_taskeval(url, served_name("smollm2"), model_dir, tmp),
                    "bench": _benchmarks(url, served_name("smollm2"), tmp), "ours": ours}
    except ServerFailed as e:
        pytest.fail(str(e))
    finally:
        pool.shutdown(wait=False)  # NOTE: the thread's waits are bounded (deployment, requests, lm-eval)


@pytest.fixture(scope="module")
def vllm_answers(reference) -> dict[str, Any]:
    return reference["answers"]


def test_every_feature_answers_as_vllm_serve(vllm_answers, reference):
    ours = reference["ours"].result(timeout=1200)["answers"]
    assert set(ours) == set(vllm_answers)
    problems: dict[str, list[str]] = {}
    for key, want in vllm_answers.items():
        out: list[str] = []
        _diff(want, ours[key], key, out)
        if out:
            problems[key] = out
    ok = [k for k in vllm_answers if k not in problems]
    print(f"\nparity: {len(ok)} of {len(vllm_answers)} requests answered exactly as vLLM serve")
    for k, v in vllm_answers.items():  # NOTE: the table exercises both outcomes: answers and refusals
        print(f"  {k}: {v['status']}")
    assert not problems, "\n".join(f"{k}:\n    " + "\n    ".join(v[:8]) for k, v in problems.items())


def test_lm_eval_scores_match_vllm_serve(reference):
    """lm-eval's loglikelihood (local-completions: echo + logprobs, prompt logprobs from the prefill engine)
    and generation (local-chat-completions) scores on the local capitals tasks equal vLLM serve's."""
    ours = reference["ours"].result(timeout=1200)["lmeval"]
    print(f"\nlm-eval: vLLM serve {reference['lmeval']}, ours {ours}")
    assert ours.keys() == reference["lmeval"].keys() and len(ours) >= 2
    assert ours == reference["lmeval"]


def test_the_table_covers_every_feature_on_every_front_end():
    names = {n for n, *_ in TABLE}
    for feature in ("n2", "logprobs", "echo", "json_schema", "regex", "choice", "tools_required", "tools_named",
                    "parts", "multi_prompt", "token_ids", "continuous_usage", "logit_bias", "stop_token_ids",
                    "min_p", "repetition_penalty", "tokenize", "detokenize", "models", "responses"):
        assert any(feature in n for n in names), feature
    assert {p for _, p, *_ in TABLE} >= {CHAT, CMPL, RESP}


# ---- the benchmark tools, unchanged, against the same vLLM server (while it is up) ---------------------
MAX_TOTAL_LEN = 512


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out = {}
    for metric in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        values = re.findall(rf"^{re.escape(metric)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
        out[metric] = sum(float(v) for v in values)
    return out


def _benchmarks(url: str, model: str, tmp: Any) -> dict[str, Any]:
    """benchmarks.serve (completions and chat) and benchmarks.quality against vLLM's own server: what the
    tests below check, recorded while the reference server runs (one server start for all of it)."""
    before = _counters(url)
    completions = run_benchmark(url, model, ChatWorkload(32, 0.5, 16, 0.5), [4.0], num_requests=6,
                                slo=SLO(ttft_s=5.0, tpot_s=1.0), max_total_len=MAX_TOTAL_LEN, warmup_requests=0,
                                request_timeout_s=120.0)
    after = _counters(url)
    chat = run_benchmark(url, model, ChatWorkload(16, 0.3, 8, 0.3), [8.0], num_requests=4, api="chat",
                         max_total_len=MAX_TOTAL_LEN, request_timeout_s=120.0)
    quality, log = _quality(url, model, tmp / "quality-vllm.json")
    return {"completions": completions, "before": before, "after": after, "chat": chat, "quality": quality,
            "quality_log": log}


QUALITY_PROMPTS = 4  # of the committed eval set's 20


def _quality(url: str, model: str, out: Any) -> tuple[dict | None, str]:
    """benchmarks.quality on one endpoint (greedy outputs of the eval set's first prompts, asked twice)."""
    cmd = [sys.executable, "-m", "benchmarks.quality", "--endpoint", url, "--model", model, "--out", str(out),
           "--limit", str(QUALITY_PROMPTS)]
    proc = subprocess.run(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    quality = json.loads(out.read_text()) if proc.returncode == 0 and out.is_file() else None
    return quality, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_benchmark_against_vllm_server(reference, tmp_path) -> None:
    """benchmarks.serve against vLLM's own server: what the client counted equals the server's counters."""
    b = reference["bench"]
    result, before, after = b["completions"], b["before"], b["after"]
    step = result.steps[0]
    s, records = step.summary, step.records
    print(json.dumps(s.to_dict(), indent=1))
    assert (s.sent, s.succeeded, s.rejected_429, s.errors) == (6, 6, 0, {})
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
    assert s.ttft.count == 6 and s.itl.count == sum(len(r.itl_s) for r in records) > 0
    for summary in (s.ttft, s.itl, s.tpot, s.e2e):
        assert summary.p50 is not None and 0 < summary.p50 <= summary.p90 <= summary.p99 <= summary.max
    assert s.attainment == pytest.approx(s.slo_met / 6)
    paths = write_report(result, tmp_path)
    assert all(p.is_file() for p in paths)
    assert json.loads((tmp_path / "report.json").read_text())["steps"][0]["summary"]["succeeded"] == 6


def test_chat_route_against_vllm_server(reference) -> None:
    result = reference["bench"]["chat"]
    s = result.steps[0].summary
    assert (s.sent, s.succeeded) == (4, 4)
    assert all(r.completion_tokens == r.output_len and r.prompt_tokens > r.input_len for r in result.steps[0].records)


def test_greedy_quality_tool_against_vllm_server(reference) -> None:
    """benchmarks.quality on vLLM's own server: token ids read from the server, the same greedy tokens when
    asked twice.

    NOTE: CI runs neither the tool's offline-vLLM source (`--offline-model-dir`, one engine start) nor the
    eval set on our endpoint (the parity table above already compares our greedy answers with vLLM serve's,
    and tests/integration/test_disagg.py with a colocated engine); the committed compare reports hold both."""
    data = reference["bench"]["quality"]
    assert data is not None, reference["bench"]["quality_log"]
    (again,) = data["comparisons"]
    assert again["exact_match_rate"] == 1.0 and all(row["unit"] == "token" for row in again["prompts"])
    assert len(data["sources"]["endpoint"]) == QUALITY_PROMPTS
    assert all(o["token_ids"] for o in data["sources"]["endpoint"])
