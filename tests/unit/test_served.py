"""The x-saaf-served record of each completion, its header and usage field, and the middleware's ordering
(the start held until the first body, so a stream's header is written once the route is known)."""

from __future__ import annotations

import asyncio
import json
import types

from cluster.router.policy import RouteDecision
from cluster.serve.context import SERVED, RequestContext
from cluster.serve.served import HEADER, ServedHeader, leg_served, with_usage_field
from kvtransfer.handoff import TransferTelemetry


def _leg(dec: RouteDecision | None, transfer: TransferTelemetry | None = None, max_tokens: int = 8,
         attempts: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(decision=dec, transfer=transfer, attempts=attempts, routed_at=0.0,
                                 first_token_at=None, prefill_s=None,
                                 params=types.SimpleNamespace(max_tokens=max_tokens))


def _tel(outcome: str = "ok", kv_bytes: int = 2_000_000, wait_s: float = 0.004, computed: int = 1) -> TransferTelemetry:
    return TransferTelemetry("r", "prefill-1", "decode-0", 2, kv_bytes, 200, 199, computed, wait_s, 0.01, "nixl",
                             "DRAM", outcome)


def test_remote_leg_reports_its_transfer_from_the_telemetry_not_the_routing() -> None:
    dec = RouteDecision(True, "prefill-0", "decode-0", placement="remote:policy")
    s = leg_served(0, _leg(dec, _tel()), colocated=False)
    # NOTE: the worker the telemetry names wins (the decision was made before a retry could move it)
    assert (s.path, s.why, s.prefill, s.decode, s.kv) == ("remote", "policy", "prefill-1", "decode-0", "ok")
    assert (s.kv_bytes, s.kv_ms, s.kv_gbps, s.decode_computed) == (2_000_000, 4.0, 0.5, 1)
    assert s.header_element() == ("index=0; path=remote; why=policy; prefill=prefill-1; decode=decode-0; kv=ok; "
                                  "kv_bytes=2000000; kv_ms=4.0; kv_gbps=0.5; decode_computed=1; tp=1:1; attempts=1")


def test_recompute_and_other_paths() -> None:
    dec = RouteDecision(True, "prefill-0", "decode-0", placement="remote:policy")
    s = leg_served(1, _leg(dec, _tel("recomputed", 0, 0.2, 200), attempts=2), colocated=False)
    assert (s.kv, s.kv_bytes, s.decode_computed, s.attempts, s.kv_gbps) == ("recomputed", 0, 200, 2, 0.0)
    local = RouteDecision(True, None, "decode-0", local=True, placement="local:short_prompt")
    s = leg_served(0, _leg(local), colocated=False)
    assert (s.path, s.why, s.prefill, s.decode, s.kv) == ("local", "short_prompt", None, "decode-0", None)
    assert "prefill=" not in s.header_element() and "kv=" not in s.header_element()
    assert leg_served(0, _leg(dec, max_tokens=1), colocated=False).path == "prefill_only"
    assert leg_served(0, _leg(RouteDecision(True, None, "colo-0")), colocated=True).path == "colocated"
    assert leg_served(0, _leg(None), colocated=False).path == "unrouted"
    pending = leg_served(0, _leg(dec), colocated=False)  # a stream's header, before the pull reported
    assert (pending.path, pending.prefill, pending.kv) == ("remote", "prefill-0", None)


def test_the_time_to_first_token_is_split_by_stage() -> None:
    dec = RouteDecision(True, "prefill-0", "decode-0", placement="remote:policy")
    leg = _leg(dec, _tel())
    leg.routed_at, leg.first_token_at, leg.prefill_s = 10.050, 10.400, 0.3
    s = leg_served(0, leg, colocated=False, arrived=10.0, created=10.020)
    assert (s.render_ms, s.admit_ms, s.prefill_ms, s.first_ms) == (20.0, 30.0, 300.0, 350.0)
    assert s.header_element().endswith("attempts=1; render_ms=20.0; admit_ms=30.0; prefill_ms=300.0; first_ms=350.0")
    leg.first_token_at = None  # not there yet: left out, not guessed
    assert "first_ms" not in leg_served(0, leg, colocated=False, arrived=10.0, created=10.020).header_element()


def test_usage_field_goes_only_into_the_final_usage_chunk() -> None:
    served = [leg_served(0, _leg(RouteDecision(True, "p", "d", placement="remote:policy"), _tel()), False)]
    token = b'data: {"choices":[{"index":0,"delta":{"content":"usage"}}],"usage":null}\n\n'
    assert with_usage_field(token, served) == token  # "usage" in the text, and a null usage: untouched
    final = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    out = with_usage_field(final, served)
    chunk = json.loads(out.split(b"\n\n")[0][6:])
    assert chunk["usage"]["prompt_tokens"] == 5 and chunk["usage"]["saaf_served"][0]["kv_bytes"] == 2_000_000
    assert out.endswith(b"\n\n")
    assert with_usage_field(b"data: [DONE]\n\n", served) == b"data: [DONE]\n\n"


def test_middleware_holds_the_start_until_the_first_body_then_adds_the_header() -> None:
    dec = RouteDecision(True, "prefill-0", "decode-0", placement="remote:policy")
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        ctx = RequestContext(1.0, 0.1)
        SERVED.get().append(ctx)  # as the serving call's wrapper does (cluster/serve/preflight.py)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        # NOTE: routed only after the start was sent: the header must still see it
        ctx.jobs.append(types.SimpleNamespace(legs=[_leg(dec)]))
        await send({"type": "http.response.body", "body": b'data: {"choices":[]}\n\n', "more_body": True})
        ctx.jobs[0].legs[0].transfer = _tel()
        await send({"type": "http.response.body",
                    "body": b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n', "more_body": False})

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(ServedHeader(app, colocated=False)({"type": "http", "method": "POST"}, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    headers = dict(sent[0]["headers"])
    assert headers[HEADER.encode()].startswith(b"index=0; path=remote; why=policy; prefill=prefill-0")
    assert json.loads(sent[2]["body"].split(b"\n\n")[0][6:])["usage"]["saaf_served"][0]["kv"] == "ok"
    assert SERVED.get() is None  # reset after the request


def test_get_requests_pass_through() -> None:
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        assert SERVED.get() is None
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(msg: dict) -> None:
        sent.append(msg)

    asyncio.run(ServedHeader(app, colocated=False)({"type": "http", "method": "GET"}, None, send))
    assert sent[0]["headers"] == []
