"""How each request was served, told to its client: proof that it really went prefill -> KV -> decode.

Every response to a generating request (chat, completions, responses, messages; streamed or not) carries
the header ``x-saaf-served``, one element per completion (HTTP list syntax, comma-separated)::

    x-saaf-served: index=0; path=remote; why=policy; prefill=prefill-0; decode=decode-0; kv=ok;
                   kv_bytes=245760; kv_ms=41.2; kv_gbps=0.006; decode_computed=1; tp=1:1; attempts=1;
                   render_ms=1.8; admit_ms=0.7; prefill_ms=305.6; first_ms=312.0

- ``path``: ``remote`` (prefilled on ``prefill``, its KV pulled over NIXL by ``decode``), ``local`` (prefilled
  on the decode worker itself, ``why`` says why: the router's ``disaggregation`` verdict, ``sibling`` of an
  n-way request, ...), ``prefill_only`` (one output token: the prefill worker alone) or ``colocated``.
- ``kv``: the transfer's outcome as the decode worker saw it: ``ok``, ``recomputed`` (decode computed the
  prompt itself: a lease or transfer timeout) or ``failed``; ``kv_bytes`` moved; ``kv_ms`` from the start of
  the pull to the decode engine's first output (the pull plus one engine step) and ``kv_gbps`` =
  bytes / that time; ``decode_computed``: prompt tokens the decode engine computed (1 when the pull
  delivered: it computes the last prompt token to sample from it); ``kv_integrity`` (with
  `transfer.integrity: true`): ``ok``, ``mismatch`` (the pulled blocks differed from the prefill's digest:
  recomputed, so the answer is still right) or ``unchecked``.
- ``tp``: ``P:D``, the tensor-parallel sizes of the prefill and decode engines (``2:1``: the decode engine
  pulled each block's heads from both prefill ranks).
- ``attempts``: workers tried (more than 1 when one died and the request was retried or migrated).
- where the time to the first token went, in ms: ``render_ms`` (the request body at the ingress -> rendered
  and validated by vLLM's serving layer), ``admit_ms`` (-> routed, the router's queue included),
  ``prefill_ms`` (the prefill worker's own time: its engine's queue and the prefill; remote path only) and
  ``first_ms`` (routed -> the first token back at the ingress: Ray hops, prefill, and on a local path the
  decode engine's prefill). ``first_ms - prefill_ms`` is what the hops to and from the prefill worker cost.

A stream's headers go out with its first event, before its transfer may have run (the prefill engine's
first token can reach the client first), so its header carries the route; the KV figures are in the final
usage chunk (``stream_options: {include_usage: true}``) as ``usage.saaf_served``: the same elements, one
object per completion. `serve.served_header: false` turns both off.

NOTE: written as ASGI middleware, not inside vLLM's serving classes: they build their responses from the
RequestOutputs alone, which have no place for this; the middleware sees the request's jobs through the
request context (cluster/serve/context.py SERVED) and holds the response's start until its first body.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from cluster.serve.context import SERVED, RequestContext

HEADER = "x-saaf-served"
USAGE_FIELD = "saaf_served"


@dataclass(frozen=True)
class LegServed:
    """How one completion was served, from its routing decision and its decode worker's transfer telemetry."""

    index: int
    path: str  # remote | local | prefill_only | colocated | unrouted
    why: str | None
    prefill: str | None
    decode: str | None
    kv: str | None = None  # ok | recomputed | failed; None: no transfer (local, colocated, not yet pulled)
    kv_bytes: int | None = None
    kv_ms: float | None = None
    kv_gbps: float | None = None
    decode_computed: int | None = None
    kv_integrity: str | None = None  # transfer.integrity: ok | mismatch | unchecked
    tp: str | None = None  # "P:D", the prefill and decode engines' TP sizes (different: heads remapped)
    attempts: int = 1
    # where the time to its first token went, ms (None where it does not apply)
    render_ms: float | None = None  # the request body at the ingress -> rendered and validated (vLLM's layer)
    admit_ms: float | None = None  # -> routed by the router (its queue included)
    prefill_ms: float | None = None  # the prefill worker's own time (engine queue + prefill), remote path
    first_ms: float | None = None  # routed -> the first token back at the ingress (Ray hops included)

    def header_element(self) -> str:
        return "; ".join(f"{k}={v}" for k, v in asdict(self).items() if v is not None)


def _ms(a: float | None, b: float | None) -> float | None:
    return round((b - a) * 1e3, 1) if a is not None and b is not None else None


def leg_served(index: int, leg: Any, colocated: bool, arrived: float | None = None,
               created: float | None = None) -> LegServed:
    """`leg` is a cluster.serve.leg.Leg (its decision, transfer telemetry, attempts and times); `arrived` when
    its request reached this middleware and `created` when its job was made (time.monotonic())."""
    routed = leg.routed_at or None
    timing = {"render_ms": _ms(arrived, created), "admit_ms": _ms(created, routed),
              "prefill_ms": round(leg.prefill_s * 1e3, 1) if leg.prefill_s is not None else None,
              "first_ms": _ms(routed, leg.first_token_at)}
    return dataclasses.replace(_route(index, leg, colocated), **timing)


def _route(index: int, leg: Any, colocated: bool) -> LegServed:
    dec = leg.decision
    if dec is None:
        return LegServed(index, "unrouted", None, None, None, attempts=leg.attempts)
    where, _, why = (dec.placement or ("local:policy" if dec.local else "remote:policy")).partition(":")
    if colocated:
        return LegServed(index, "colocated", None, None, dec.decode, attempts=leg.attempts)
    if dec.local:
        return LegServed(index, "local", why or None, None, dec.decode, attempts=leg.attempts)
    if (leg.params.max_tokens or 1) == 1:
        return LegServed(index, "prefill_only", None, dec.prefill, None, attempts=leg.attempts)
    t = leg.transfer
    if t is None:  # NOTE: streamed, and its pull has not reported yet (the header goes out first)
        return LegServed(index, "remote", why or None, dec.prefill, dec.decode, attempts=leg.attempts)
    secs = t.transfer_wait_s
    return LegServed(index, "remote", why or None, t.prefill_worker, t.decode_worker, t.outcome, t.kv_bytes,
                     round(secs * 1e3, 2), round(t.kv_bytes / secs / 1e9, 4) if secs > 0 else None,
                     t.decode_computed_prompt_tokens, t.integrity or None, f"{t.prefill_tp}:{t.decode_tp}",
                     leg.attempts)


def request_served(contexts: list[RequestContext], colocated: bool, arrived: float | None = None) -> list[LegServed]:
    """Every completion of the request, in order: the jobs of each serving call, their legs."""
    out: list[LegServed] = []
    for ctx in contexts:
        for job in ctx.jobs:
            for leg in job.legs:
                out.append(leg_served(len(out), leg, colocated, arrived, getattr(job, "t0", None)))
    return out


def with_usage_field(body: bytes, served: list[LegServed]) -> bytes:
    """An SSE body message with its final usage chunk (`"choices": []` and a usage object) given
    `usage.saaf_served`; any other message as it was."""
    if b'"usage"' not in body or not body.startswith(b"data: {"):
        return body
    out = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                chunk = json.loads(event[6:])
            except ValueError:
                out.append(event)
                continue
            if isinstance(chunk.get("usage"), dict) and not chunk.get("choices"):
                chunk["usage"][USAGE_FIELD] = [asdict(s) for s in served]
                event = b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out)


class ServedHeader:
    """Pure ASGI middleware: POST responses get `x-saaf-served` once their first body is ready; SSE
    streams get `usage.saaf_served` in their final usage chunk."""

    def __init__(self, app: Any, *, colocated: bool) -> None:
        self.app = app
        self.colocated = colocated

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        contexts: list[RequestContext] = []
        token = SERVED.set(contexts)
        arrived = time.monotonic()
        start: dict | None = None
        sse = False

        async def send_served(msg: dict) -> None:
            nonlocal start, sse
            if msg["type"] == "http.response.start":
                start = msg  # NOTE: held until the first body: the route is known by then
                sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in msg.get("headers", []))
                return
            if msg["type"] == "http.response.body":
                served = request_served(contexts, self.colocated, arrived)
                if start is not None:
                    if served:
                        value = ", ".join(s.header_element() for s in served)
                        start = {**start, "headers": [*start.get("headers", []), (HEADER.encode(), value.encode())]}
                    await send(start)
                    start = None
                if sse and served:
                    msg = {**msg, "body": with_usage_field(msg.get("body", b""), served)}
            await send(msg)

        try:
            await self.app(scope, receive, send_served)
        finally:
            SERVED.reset(token)
            if start is not None:  # NOTE: a start never followed by a body (the app ended): sent as it was
                await send(start)
