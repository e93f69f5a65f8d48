"""What the ingress checks before vLLM's serving layer sees a request (pure ASGI middleware):

- in flight: at most `serve.max_inflight` POST requests per replica; beyond it 429 with Retry-After at once
  (requests are parsed and rendered only once admitted here, so a flood costs almost nothing);
- draining: new POST requests get 503 `shutting_down` once shutdown began;
- the body: larger than `serve.max_body_bytes` (declared or, for chunked bodies, counted while reading) is a
  413 before the rest is read; a body not complete within `serve.body_timeout_s` of its first byte being
  awaited (a slow or stalled client) is a 408, so it holds an in-flight slot no longer than that; invalid UTF-8 and \\u escapes of lone UTF-16 surrogates are 400s (the
  tokenizer would fail on them later, as a 500).

Errors use the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

from cluster.errors import ServeError, rate_limited, shutting_down

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(data: Any) -> bool:
    """True when a string (key or value) anywhere in ``data`` is not encodable as UTF-8. Iterative: the
    body can be nested as deep as the JSON parser allows."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return False


async def send_error(send: Callable[..., Any], e: ServeError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Any, *, max_body_bytes: int, max_inflight: int, draining: Callable[[], bool],
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_inflight = max_inflight
        self.draining = draining
        self.inflight = 0

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.draining():
            await send_error(send, shutting_down("the server is shutting down and takes no new requests; "
                                                 "retry shortly"))
            return
        if self.inflight >= self.max_inflight:
            await send_error(send, rate_limited(f"{self.max_inflight} requests in flight on this replica "
                                                "(serve.max_inflight); retry shortly", code="overloaded"))
            return
        self.inflight += 1
        try:
            try:
                body = await self._read(scope, receive)
            except ServeError as e:
                await send_error(send, e)
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.inflight -= 1

    async def _read(self, scope: dict, receive: Callable[..., Any]) -> bytes:
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            raise ServeError(413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit "
                                  "(serve.max_body_bytes)", code="body_too_large")
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ServeError(408, f"request body not received within {self.body_timeout_s:g}s "
                                      "(serve.body_timeout_s); send it faster or raise the limit",
                                 code="body_timeout") from None
            if msg["type"] == "http.disconnect":
                raise ServeError(400, "client disconnected while sending the body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ServeError(413, f"request body exceeds the {limit}-byte limit (serve.max_body_bytes)",
                                 code="body_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise ServeError(400, "request body is not valid UTF-8") from None
        if _SURROGATE_ESCAPE.search(body):
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):
                return body  # NOTE: malformed JSON: vLLM's layer answers it with a 400
            if _has_lone_surrogate(data):
                raise ServeError(400, "request body has a \\u escape of a lone UTF-16 surrogate; send valid "
                                      "Unicode")
        return body


def _replay(body: bytes, receive: Callable[..., Any]) -> Callable[..., Any]:
    """A receive() that yields the buffered body once, then the client's own messages (disconnects)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
