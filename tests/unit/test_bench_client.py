"""The streaming client's timings and failure accounting, against an in-memory SSE transport."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from benchmarks.client import RequestRecord, endpoint_url, request_body, send_request


def _sse(events: list[dict | str], gap_s: float) -> Callable[[], AsyncIterator[bytes]]:
    async def stream() -> AsyncIterator[bytes]:
        for event in events:
            await asyncio.sleep(gap_s)
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()

    return stream


def _text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t}]}


def _usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def _run(handler: Callable[[httpx.Request], httpx.Response], api: str = "completions",
         timeout_s: float = 5.0) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            rec = RequestRecord(0, 8, 4, 0.0)
            body = request_body("m", "hello", 4, api, ignore_eos=True)
            return await send_request(client, "http://127.0.0.1:1/v1/x", body, api, rec, timeout_s,
                                      time.perf_counter())

    return asyncio.run(go())


def test_ttft_itl_and_usage_from_stream() -> None:
    events = [_text("a"), _text(""), _text("b"), _text("c"), _usage(8, 4), "[DONE]"]
    rec = _run(lambda req: httpx.Response(200, content=_sse(events, 0.05)()))
    assert rec.ok and rec.status == 200
    assert rec.ttft_s is not None and rec.ttft_s >= 0.05
    # three content chunks -> two gaps; the empty chunk is not content, so one gap spans it (~0.1 s)
    assert rec.chunks == 3 and len(rec.itl_s) == 2
    assert rec.itl_s[0] >= 0.1 - 0.01 and rec.itl_s[1] >= 0.05 - 0.01
    assert (rec.prompt_tokens, rec.completion_tokens, rec.usage_reported) == (8, 4, True)
    assert rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-6


def test_chat_role_chunk_is_not_the_first_token() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tok = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    rec = _run(lambda req: httpx.Response(200, content=_sse([role, tok, tok, "[DONE]"], 0.05)()), api="chat")
    assert rec.ttft_s is not None and rec.ttft_s >= 0.1 - 0.01
    assert rec.chunks == 2 and rec.usage_reported is False and rec.completion_tokens == 2


def test_request_body_shapes() -> None:
    chat = request_body("m", "hi", 7, "chat", ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    comp = request_body("m", "hi", 7, "completions", ignore_eos=True)
    assert comp["prompt"] == "hi" and comp["ignore_eos"] is True and comp["max_tokens"] == 7
    assert comp["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("status", "kind"), [(429, "rejected_429"), (500, "http_500"), (404, "http_404")])
def test_http_errors_are_recorded(status: int, kind: str) -> None:
    rec = _run(lambda req: httpx.Response(status, text="busy"))
    assert not rec.ok and rec.status == status and rec.error_kind == kind and rec.error == "busy"


def test_refusal_time_is_recorded() -> None:
    async def slow_refusal() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.2)
        yield b'{"error": {"code": "slo_unattainable"}}'

    rec = _run(lambda req: httpx.Response(429, content=slow_refusal()))
    assert rec.status == 429 and rec.ttft_s is None
    assert rec.e2e_s is not None and 0.2 - 0.01 <= rec.e2e_s < 2.0


def test_error_event_inside_stream() -> None:
    events = [_text("a"), {"error": {"message": "engine died", "code": 500}}]
    rec = _run(lambda req: httpx.Response(200, content=_sse(events, 0.0)()))
    assert not rec.ok and rec.error_kind == "stream_error" and "engine died" in (rec.error or "")


def test_slow_stream_times_out() -> None:
    rec = _run(lambda req: httpx.Response(200, content=_sse([_text("a")] * 10, 0.2)()), timeout_s=0.3)
    assert not rec.ok and rec.error_kind == "timeout"


def test_empty_stream_is_an_error() -> None:
    rec = _run(lambda req: httpx.Response(200, content=_sse([_usage(8, 0), "[DONE]"], 0.0)()))
    assert not rec.ok and rec.error_kind == "no_content"


def test_connection_error_is_recorded() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    rec = _run(refuse)
    assert not rec.ok and rec.status is None and rec.error_kind == "ConnectError"


def test_endpoint_url() -> None:
    assert endpoint_url("http://127.0.0.1:8000", "chat") == "http://127.0.0.1:8000/v1/chat/completions"
    assert endpoint_url("http://127.0.0.1:8000/v1/", "completions") == "http://127.0.0.1:8000/v1/completions"
    with pytest.raises(ValueError, match="not an http"):
        endpoint_url("127.0.0.1:8000", "chat")
    with pytest.raises(ValueError, match="one of"):
        endpoint_url("http://127.0.0.1:8000", "embeddings")
