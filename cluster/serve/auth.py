"""API keys on the endpoint (pure ASGI middleware, in front of everything else the ingress does).

With `serve.api_keys` set, every request must carry one of the keys as `Authorization: Bearer KEY` (what
OpenAI clients send) or `x-api-key: KEY` (what Anthropic clients send to /v1/messages); anything else is a
401 with an OpenAI-style error body and `WWW-Authenticate: Bearer`, before the request counts against
`serve.max_inflight` or its body is read. /health and /metrics are open unless `serve.auth_health` /
`serve.auth_metrics` say otherwise (load balancers and Prometheus scrape them).

NOTE: our own, not vLLM's `--api-key` middleware: vLLM's answers `{"error": "Unauthorized"}` (not the
OpenAI error shape clients parse), checks only /v1 paths, and compares plain strings. Here the replica
holds only SHA-256 digests of the keys (cluster/config.py resolves inline, env and file keys on the driver),
and compares digests in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any

from cluster.config import key_digest
from cluster.errors import ServeError
from cluster.serve.guard import send_error


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key: KEY`; None without one."""
    bearer = api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
        elif name == b"x-api-key" and value.strip():
            api_key = value.decode("latin-1").strip()
    return bearer or api_key


def own_path(scope: dict) -> str:
    """The request's path inside this app (without the route prefix it is mounted under). NOTE: matched
    exactly: a suffix match let `/v1/chat/completions/x/health` through."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class Auth:
    def __init__(self, app: Any, *, digests: list[str], auth_health: bool, auth_metrics: bool) -> None:
        self.app = app
        self.digests = [d.lower() for d in digests]
        self.open_paths = tuple(p for p, closed in (("/health", auth_health), ("/metrics", auth_metrics))
                                if not closed)

    def allowed(self, key: str | None) -> bool:
        if key is None:
            return False
        d = key_digest(key)
        # NOTE: every digest compared, in constant time each: no early exit tells which prefix matched
        return sum(hmac.compare_digest(d, want) for want in self.digests) > 0

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or own_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope.get("headers") or [])
        if not self.allowed(key):
            why = "no API key given" if key is None else "the API key is not valid"
            await send_error(send, ServeError(
                401, f"{why}: send `Authorization: Bearer <key>` with one of the endpoint's keys (serve.api_keys)",
                type_="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        await self.app(scope, receive, send)
