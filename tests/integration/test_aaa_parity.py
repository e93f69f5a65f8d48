"""The contract of our OpenAI surface: the same answers as vLLM's own server.

vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, same model and settings, greedy
or seeded, one colocated engine) answers a table of requests (each feature, streamed and not); it is
stopped, then our disaggregated deployment answers the same table, and the two are compared field by field
except ids, timestamps and `system_fingerprint`, with logprob floats within LOGPROB_TOL. The file sorts
first so the reference runs before the session's deployment starts (never both servers at once on 2 cores).
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from tests.helpers.parity_table import CHAT, CMPL, RESP, TABLE, TOOL_ARGS

pytestmark = pytest.mark.integration

LOGPROB_TOL = 2e-3  # absolute, on log-probabilities (fp32 CPU kernels batch differently in the two systems)
DROP = {"id", "created", "created_at", "system_fingerprint", "call_id", "item_id", "response_id"}


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """vLLM serve's answers to the table and its lm-eval scores, recorded before our deployment starts."""
    from engine.models import resolve_model, served_name
    from tests.helpers.lmeval import run_lmeval
    from tests.helpers.vllm_server import ServerFailed, vllm_server

    tmp = tmp_path_factory.mktemp("vllm-ref")
    model_dir = resolve_model("smollm2")
    try:
        with vllm_server(model_dir, served_name("smollm2"), tmp / "server.log", max_model_len=1024,
                         extra=TOOL_ARGS) as url:
            return {"answers": record(url), "lmeval": run_lmeval(url, served_name("smollm2"), model_dir, tmp)}
    except ServerFailed as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def vllm_answers(reference) -> dict[str, Any]:
    return reference["answers"]


def test_every_feature_answers_as_vllm_serve(vllm_answers, endpoint):
    ours = record(endpoint)
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


def test_lm_eval_scores_match_vllm_serve(reference, endpoint, model_name, tmp_path):
    """lm-eval's loglikelihood (local-completions: echo + logprobs, prompt logprobs from the prefill engine)
    and generation (local-chat-completions) scores on the local capitals tasks equal vLLM serve's."""
    from engine.models import resolve_model
    from tests.helpers.lmeval import run_lmeval

    ours = run_lmeval(endpoint, model_name, resolve_model("smollm2"), tmp_path)
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
