"""The ingress's Guard (cluster/serve/guard.py) and request context, on a bare ASGI app (no Ray, no vLLM)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.config import SLOConfig
from cluster.errors import ServeError
from cluster.serve.context import RequestContext
from cluster.serve.guard import Guard


async def _echo(scope, receive, send) -> None:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _call(guard: Guard, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
          method: str = "POST") -> tuple[int, bytes, dict]:
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m: dict) -> None:
        sent.append(m)

    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": headers or []}
    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, {k.decode(): v.decode() for k, v in start.get("headers", [])}


def guard(**kw) -> Guard:
    return Guard(_echo, **({"max_body_bytes": 100, "max_inflight": 4, "draining": lambda: False} | kw))


def test_a_body_within_the_limit_reaches_the_app_whole() -> None:
    status, body, _ = _call(guard(), [b'{"a": ', b'"b"}'])
    assert (status, body) == (200, b'{"a": "b"}')


def test_a_declared_length_over_the_limit_is_a_413_before_reading() -> None:
    status, body, _ = _call(guard(), [b"x" * 10], headers=[(b"content-length", b"1000")])
    assert status == 413 and "100-byte limit" in json.loads(body)["error"]["message"]


def test_a_chunked_body_is_cut_at_the_limit() -> None:
    status, body, _ = _call(guard(), [b"x" * 60, b"x" * 60, b"x" * 10_000])
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("raw,needle", [(b"\xff\xfe", "UTF-8"), (b'{"p": "\\ud800"}', "surrogate")])
def test_bad_text_is_a_400(raw: bytes, needle: str) -> None:
    status, body, _ = _call(guard(), [raw])
    assert status == 400 and needle in json.loads(body)["error"]["message"]


def test_a_valid_surrogate_pair_passes() -> None:
    assert _call(guard(), [b'{"p": "\\ud83d\\ude00"}'])[0] == 200


def test_beyond_max_inflight_is_a_429_with_retry_after() -> None:
    g = guard(max_inflight=1)
    g.inflight = 1  # one request already in flight on this replica
    status, body, headers = _call(g, [b"{}"])
    assert status == 429 and headers["retry-after"] and json.loads(body)["error"]["code"] == "overloaded"


def test_draining_is_a_503_and_gets_do_not_count() -> None:
    status, body, _ = _call(guard(draining=lambda: True), [b"{}"])
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    g = guard()
    assert _call(g, [b""], method="GET")[0] == 200 and g.inflight == 0


def test_slo_headers_only_tighten_the_deployment_target() -> None:
    slo = SLOConfig(ttft_ms=2000, tpot_ms=200)
    assert RequestContext.from_headers({}, slo).ttft_slo_s == 2.0
    tight = RequestContext.from_headers({"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "50"}, slo)
    assert (tight.ttft_slo_s, tight.tpot_slo_s) == (0.5, 0.05)
    loose = RequestContext.from_headers({"x-slo-ttft-ms": "900000", "x-slo-tpot-ms": "9000"}, slo)
    assert (loose.ttft_slo_s, loose.tpot_slo_s) == (2.0, 0.2)  # capped: no client opts out of admission
    for bad in ("soon", "0", "-5", "1e99"):
        with pytest.raises(ServeError) as e:
            RequestContext.from_headers({"x-slo-ttft-ms": bad}, slo)
        assert e.value.status == 400 and "x-slo-ttft-ms" in e.value.message


def test_a_stalled_body_is_a_408_within_the_body_timeout_and_frees_its_slot() -> None:
    """A client that sends part of its body and then nothing: 408 after serve.body_timeout_s, not a slot held
    until the client gives up."""
    import time

    g = guard(body_timeout_s=0.3)
    sent: list[dict] = []
    first = [{"type": "http.request", "body": b'{"a": ', "more_body": True}]

    async def receive() -> dict:
        if first:
            return first.pop()
        await asyncio.sleep(3600)  # NOTE: the rest never comes
        return {"type": "http.disconnect"}

    async def send(m: dict) -> None:
        sent.append(m)

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(g({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                                   receive, send), 10))
    assert 0.25 < time.monotonic() - t0 < 3
    assert sent[0]["status"] == 408 and json.loads(sent[1]["body"])["error"]["code"] == "body_timeout"
    assert g.inflight == 0
