"""The committed eval set and the greedy-output comparison (no server, no engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.quality import (
    EvalPrompt,
    GreedyOutput,
    _token_ids,
    compare,
    endpoint_greedy,
    first_divergence,
    format_comparison,
    load_evalset,
)


def test_committed_evalset_is_varied_and_well_formed() -> None:
    prompts = load_evalset()
    assert len(prompts) >= 20
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.prompt for p in prompts}) == len(prompts)
    assert all(1 <= p.max_tokens <= 64 for p in prompts)
    # fits a 512-token test server even at ~4 characters per token
    assert all(len(p.prompt) // 2 + p.max_tokens < 512 for p in prompts)


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([5], [6]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix diverges where the shorter one ends
    assert first_divergence([], []) is None


def test_compare_uses_token_ids_when_both_have_them() -> None:
    a = [GreedyOutput("p1", "x y", [1, 2]), GreedyOutput("p2", "ab", [3, 4, 5]), GreedyOutput("p3", "q", None)]
    b = [GreedyOutput("p3", "r", None), GreedyOutput("p1", "x y", [1, 2]), GreedyOutput("p2", "ac", [3, 7, 5])]
    c = compare(a, b, "disagg", "offline")
    rows = {r.id: r for r in c.prompts}
    assert c.exact_match_rate == pytest.approx(1 / 3)
    assert rows["p1"].match and rows["p1"].first_divergence is None
    assert (rows["p2"].unit, rows["p2"].first_divergence) == ("token", 1)
    assert (rows["p3"].unit, rows["p3"].first_divergence) == ("char", 0)
    assert "DIFF p2: first divergent token 1" in format_comparison(c)
    with pytest.raises(ValueError, match="not in offline"):
        compare(a, b[:1], "disagg", "offline")


def test_token_ids_from_vllm_fields() -> None:
    assert _token_ids({"token_ids": [7, 8]}, "completions") == [7, 8]
    assert _token_ids({"logprobs": {"tokens": ["token_id:3", "token_id:4"]}}, "completions") == [3, 4]
    chat = {"logprobs": {"content": [{"token": "token_id:9"}, {"token": "token_id:1"}]}}
    assert _token_ids(chat, "chat") == [9, 1]
    assert _token_ids({"logprobs": {"tokens": [" the", " cat"]}}, "completions") is None
    assert _token_ids({"text": "x"}, "completions") is None


def test_endpoint_greedy_falls_back_to_text_when_extensions_are_rejected() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "return_token_ids" in body:
            return httpx.Response(400, json={"error": "unknown field return_token_ids"})
        return httpx.Response(200, json={"choices": [{"index": 0, "text": body["prompt"].upper()}]})

    prompts = [EvalPrompt("a", "hi", 4), EvalPrompt("b", "yo", 4)]
    outs = endpoint_greedy("http://127.0.0.1:9", "m", prompts, transport=httpx.MockTransport(handler))
    assert [(o.id, o.text, o.token_ids) for o in outs] == [("a", "HI", None), ("b", "YO", None)]
    assert all(b["temperature"] == 0.0 and b["stream"] is False for b in seen)
    assert len(seen) == 3  # one rejected try, then plain requests only


def test_endpoint_greedy_reports_server_errors() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500, text="boom"))
    with pytest.raises(RuntimeError, match="answered 500 for prompt 'a'"):
        endpoint_greedy("http://127.0.0.1:9", "m", [EvalPrompt("a", "hi", 4)], transport=transport)
