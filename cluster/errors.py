"""The one error type the serving side raises for what a client must see (an HTTP status and an
OpenAI-style body); the HTTP layer renders it, the router and the request runner raise it."""

from __future__ import annotations

from typing import Any


class ServeError(Exception):
    """`status` is the HTTP status; `code` a short machine-readable reason (e.g. `slo_unattainable`)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s
        self._headers = dict(headers or {})

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return dict(self._headers)
        return {**self._headers, "Retry-After": str(max(1, round(self.retry_after_s)))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def rate_limited(message: str, code: str | None = None, retry_after_s: float = 1.0) -> ServeError:
    return ServeError(429, message, type_="rate_limit_exceeded", code=code, retry_after_s=retry_after_s)


def unavailable(message: str, code: str | None = None, retry_after_s: float = 5.0) -> ServeError:
    return ServeError(503, message, type_="service_unavailable", code=code, retry_after_s=retry_after_s)


def shutting_down(message: str) -> ServeError:
    return unavailable(message, code="shutting_down")


def too_many(asked: int, cap: int) -> ServeError:
    """One request asked for more completions than serve.max_completions_per_request allows."""
    return ServeError(400, f"this request asks for {asked} or more completions (n x prompts); at most {cap} per "
                           "request (serve.max_completions_per_request): lower n or send fewer prompts",
                      param="n", code="too_many_completions")
