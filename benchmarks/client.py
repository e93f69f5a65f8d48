"""Streaming OpenAI-compatible client: one request in, one ``RequestRecord`` of its timings out.

Timings use ``time.perf_counter``. TTFT runs from just before the request is sent to the arrival of
the first SSE chunk with non-empty content; each later content chunk adds one inter-chunk gap to
``itl_s`` (a chunk may carry more than one token). Token counts come from the server's final
``usage`` chunk (``stream_options.include_usage``); servers that omit it get content-chunk counts and
``usage_reported=False``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

import httpx

logger = logging.getLogger(__name__)

ApiKind = Literal["completions", "chat"]
APIS: tuple[str, ...] = ("completions", "chat")
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start_s`` is relative to the start of its rate step."""

    index: int
    input_len: int
    output_len: int
    scheduled_s: float
    start_s: float = 0.0
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    served: list[dict] | None = None  # our deployments: how each completion was served (usage.saaf_served)
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_kind is None and self.ttft_s is not None


def endpoint_url(endpoint: str, api: str) -> str:
    """``http://host:port`` (optionally ending in ``/v1``) -> the full URL of ``api``'s route."""
    if api not in _PATHS:
        raise ValueError(f"api {api!r} is not supported; use one of: {', '.join(APIS)}")
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"endpoint {endpoint!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")
    base = endpoint.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + _PATHS[api]


def request_body(model: str, prompt: str, max_tokens: int, api: str, ignore_eos: bool,
                 temperature: float = 0.0) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        # NOTE: a vLLM extension; without it a model may stop early and output lengths drift from the
        # workload's. Servers that reject unknown fields need ignore_eos=False.
        body["ignore_eos"] = True
    return body


def make_client(timeout_s: float, max_connections: int = 1024, api_key: str | None = None) -> httpx.AsyncClient:
    # NOTE: trust_env=False: proxy variables must never route benchmark traffic off this host.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=False,
        headers=headers,
    )


def first_model(endpoint: str, api_key: str | None) -> str:
    """The first model id listed by ``GET /v1/models``."""
    url = endpoint_url(endpoint, "chat").replace("/chat/completions", "/models")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, timeout=10.0, trust_env=False, headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"could not list models at {url} ({exc}); pass --model NAME") from exc


def _content(event: dict, api: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if api == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _stream(client: httpx.AsyncClient, url: str, body: dict, api: str, rec: RequestRecord,
                  t_send: float) -> None:
    last: float | None = None
    async with client.stream("POST", url, json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            rec.error_kind = "rejected_429" if resp.status_code == 429 else f"http_{resp.status_code}"
            rec.error = text[:300]
            rec.e2e_s = time.perf_counter() - t_send  # how long a refusal took: "at once" is checked on it
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                rec.error_kind, rec.error = "stream_error", str(event["error"])[:300]
                return
            if event.get("usage"):
                rec.prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
                rec.completion_tokens = int(event["usage"].get("completion_tokens") or 0)
                rec.usage_reported = True
                rec.served = event["usage"].get("saaf_served")
            if not _content(event, api):
                continue
            rec.chunks += 1
            if last is None:
                rec.ttft_s = now - t_send
            else:
                rec.itl_s.append(now - last)
            last = now
    rec.e2e_s = time.perf_counter() - t_send
    if rec.ttft_s is None:
        rec.error_kind, rec.error = "no_content", "the stream ended without any content chunk"
    elif not rec.usage_reported:
        rec.completion_tokens = rec.chunks


async def send_request(client: httpx.AsyncClient, url: str, body: dict, api: str, rec: RequestRecord,
                       timeout_s: float, step_t0: float) -> RequestRecord:
    """Send one streaming request and fill ``rec``; never raises for request failures."""
    t_send = time.perf_counter()
    rec.start_s = t_send - step_t0
    try:
        await asyncio.wait_for(_stream(client, url, body, api, rec, t_send), timeout=timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        rec.error_kind, rec.error = "timeout", f"no complete response within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        rec.error_kind, rec.error = type(exc).__name__, str(exc)[:300]
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
        rec.error_kind, rec.error = "bad_stream", f"{type(exc).__name__}: {exc}"[:300]
    if rec.error_kind is not None:
        logger.debug("request %d failed: %s %s", rec.index, rec.error_kind, rec.error)
    return rec
