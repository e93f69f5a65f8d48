"""One `EngineClient.generate()` call: `n` legs (one per completion, each with its own prefill, KV and
decode), their outputs merged into the RequestOutputs vLLM's serving layer expects, and the request's
metrics (TTFT, ITL, tokens, SLO met) recorded once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from cluster.errors import ServeError
from cluster.router.policy import PREFIX_MIN, RouteRequest, prefix_ladder
from cluster.serve.leg import Leg, Services, first_token_carries

_DONE = object()


def leg_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of an n-way request as its own n=1 request (vLLM's own children: seed + index)."""
    p = params.clone()
    p.n = 1
    if params.seed is not None:
        p.seed = params.seed + index
    if index:
        p.prompt_logprobs = None  # NOTE: one copy of the prompt's logprobs per request
    return p


class Job:
    def __init__(self, svc: Services, request_id: str, ids: list[int], prompt_text: str | None,
                 params: SamplingParams, ttft_slo_s: float, tpot_slo_s: float, client_id: str | None = None) -> None:
        self.svc = svc
        self.request_id = request_id  # ours, unique: every leg's and engine request's id derives from it
        self.client_id = client_id or request_id  # what the client's outputs carry
        self.ids = ids
        self.prompt_text = prompt_text
        self.kind = params.output_kind
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.t0 = time.monotonic()
        self._failure_counted = False
        # NOTE: the engine client's bookkeeping; a stream refused before it starts is closed, never iterated
        self.on_close: Callable[[], None] | None = None
        deadline = self.t0 + svc.cfg.serve.request_timeout_s
        ladder = prefix_ladder(ids)  # NOTE: its first rung is the hash of the first PREFIX_MIN tokens
        route = RouteRequest(len(ids), params.max_tokens or 1, ttft_slo_s, tpot_slo_s,
                             ladder[0][1] if ladder else hash(tuple(ids[:PREFIX_MIN])), ladder,
                             first_token_carries(params))
        n = params.n or 1
        # NOTE: n > 1 prefills the prompt once: completions 1..n-1 follow completion 0 onto its decode worker
        # (Leg.lead). Not for a single token: completion 0 then ends on the prefill worker, nothing to share.
        share = n > 1 and (params.max_tokens or 1) > 1
        self.legs: list[Leg] = []
        for i in range(n):
            lead = self.legs[0] if share and i else None
            self.legs.append(Leg(svc, request_id if n == 1 else f"{request_id}-c{i}", ids, leg_params(params, i),
                                 route, deadline, lead=lead))
        self.cached_tokens = 0
        if svc.traffic is not None:
            svc.traffic.arrival(len(ids), n)

    async def admit(self) -> None:
        """Route every leg (the first decision of each); raises ServeError when refused (counted once)."""
        try:
            for leg in self.legs:
                await leg.admit()
        except ServeError as e:
            self._count_failure(e)
            raise

    def _count_failure(self, e: ServeError) -> None:
        if not self._failure_counted:
            self._failure_counted = True
            self.svc.metrics.requests.labels("rejected" if e.status == 429 else "error").inc()

    def close(self) -> None:
        for leg in self.legs:
            leg.close()
        if self.on_close is not None:
            self.on_close()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        m = self.svc.metrics
        ok, first_at, last_at = False, None, None
        try:
            await self.admit()
            merged: RequestOutput | None = None
            async for index, out in self._merge():
                now = time.monotonic()
                n_new = sum(len(c.token_ids) for c in out.outputs)
                if n_new:
                    if first_at is None:
                        first_at = now
                        m.ttft.observe(now - self.t0)
                    elif last_at is not None:
                        m.itl.observe(now - last_at)
                    last_at = now
                self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens or 0)
                out = self._adapt(out, index)
                if self.kind == RequestOutputKind.DELTA:
                    yield out
                    continue
                if merged is None:
                    merged = out
                else:
                    merged.add(out, aggregate=True)
                    merged.outputs.sort(key=lambda c: c.index)
                if self.kind == RequestOutputKind.CUMULATIVE:
                    yield merged
            if merged is not None and self.kind == RequestOutputKind.FINAL_ONLY:
                yield merged
            ok = True
        except ServeError as e:
            self._count_failure(e)
            raise
        finally:
            self.close()
            self._record(ok, first_at)

    def _adapt(self, out: RequestOutput, index: int) -> RequestOutput:
        out.request_id = self.client_id
        out.prompt, out.prompt_token_ids = self.prompt_text, self.ids
        out.kv_transfer_params = None
        for c in out.outputs:
            c.index = index
        out.finished = out.finished and all(leg.done for leg in self.legs)
        return out

    async def _merge(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(leg index, output) from every leg as they come."""
        if len(self.legs) == 1:
            leg = self.legs[0]
            async for out in leg.outputs():
                leg.done = leg.done or out.finished
                yield 0, out
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(i: int, leg: Leg) -> None:
            try:
                async for out in leg.outputs():
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
            finally:
                await queue.put(_DONE)

        tasks = [asyncio.ensure_future(pump(i, leg)) for i, leg in enumerate(self.legs)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    i, out = item
                    self.legs[i].done = self.legs[i].done or out.finished
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    def _record(self, ok: bool, first_at: float | None) -> None:
        m = self.svc.metrics
        n_out = sum(leg.tokens for leg in self.legs)
        m.tokens.labels("input").inc(len(self.ids))
        m.tokens.labels("output").inc(n_out)
        if not ok:
            return
        e2e = time.monotonic() - self.t0
        m.requests.labels("ok").inc()
        m.e2e.observe(e2e)
        ttft = (first_at or time.monotonic()) - self.t0
        per_leg = max(leg.tokens for leg in self.legs)
        tpot = (e2e - ttft) / (per_leg - 1) if per_leg > 1 else 0.0
        m.slo(ttft <= self.ttft_slo_s and tpot <= self.tpot_slo_s)
        if self.svc.traffic is not None:
            decs = [leg.decision for leg in self.legs if leg.decision is not None]
            local = any(d.local for d in decs)
            colocated = self.svc.cfg.mode == "colocated"
            role = "colocated" if colocated else "decode"
            # NOTE: who computed the prompt: the prefill worker, else (local prefill, colocated) the decode one
            prompt_by = [(d.prefill, "prefill") if d.prefill and not d.local and not colocated else (d.decode, role)
                         for d in decs if d.decode or d.prefill]
            decoded_by = [(d.decode, role) for d in decs if d.decode]
            self.svc.traffic.finished(len(self.ids), [leg.tokens for leg in self.legs], ttft, tpot, self.cached_tokens,
                                      local, prompt_by, decoded_by)
