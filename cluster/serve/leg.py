"""One completion of a request (n=1) across the pools.

    admit():   the router picks (prefill p, decode d), or queues / refuses the request (Admission)
    outputs(): p.prefill() -> KVHandoff -> d.decode_stream() pulls the KV over NIXL and streams RequestOutputs
               (colocated mode, or max_tokens == 1: one worker's generate_stream())
    close():   cancels every Ray task in flight (the workers abort their engine requests) and releases a
               handoff whose decode never started, so the prefill engine frees its blocks at once

A worker that dies is retried elsewhere (or on the same worker once Ray restarts it); a decode worker lost
mid-stream is migrated: prompt + the tokens already streamed are prefilled again and decoding continues, so
the client's stream goes on. Every wait is bounded by the request's deadline (serve.request_timeout_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from cluster.config import DeployConfig
from cluster.errors import unavailable
from cluster.router.admission import Admission
from cluster.router.policy import RouteDecision, RouteRequest
from cluster.serve import workers
from cluster.serve.membership import Membership
from cluster.serve.metrics import Metrics
from cluster.serve.traffic import TrafficLog
from cluster.serve.transfers import TransferLog
from cluster.serve.workers import WorkerDied
from kvtransfer.handoff import KVHandoff, TransferTelemetry

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 4


class Services(NamedTuple):
    """What a leg talks to; one set per ingress replica."""

    cfg: DeployConfig
    members: Membership
    admission: Admission
    metrics: Metrics
    transfers: TransferLog
    traffic: TrafficLog | None = None  # for the planner loop (None when planner_loop.mode is off)


def first_token_carries(params: Any) -> bool:
    """Can the prefill engine's first token be the client's, with decoding continuing from prompt + token?

    Not when sampling state would not carry over to the decode engine, which sees the token as part of its
    prompt: a grammar (structured output, tool choice), output-count penalties, a seed (its RNG stream),
    stop strings (one could span the first two tokens) and bad words (multi-token sequences). Those keep
    the regenerate path: the decode engine samples token 1 itself, so the whole output is its own."""
    return (params.structured_outputs is None and not params.frequency_penalty and not params.presence_penalty
            and params.seed is None and not params.stop and not params.bad_words)


def _movable(params: Any) -> bool:
    """Can decoding continue elsewhere from prompt + streamed tokens and sample what it would have?
    Not with a grammar (its state is not carried), output-count penalties or a seed (its RNG stream)."""
    return (params.structured_outputs is None and not params.frequency_penalty and not params.presence_penalty
            and params.seed is None)


class Leg:
    def __init__(self, svc: Services, request_id: str, ids: list[int], params: Any, route: RouteRequest,
                 deadline: float, lead: Leg | None = None) -> None:
        self.svc = svc
        # NOTE: completion i > 0 of an n-way request is a sibling of completion 0 (its lead): the prompt is
        # prefilled once, for the lead. When the lead's prefill hands its KV off, every sibling pulls that KV
        # itself onto the lead's decode worker (the handoff counts its readers, kvtransfer/connector.py) and
        # samples its own first token there: one prompt token computed per sibling. When the lead prefills
        # on its decode worker (a local prefill, colocated mode), a sibling runs there once the lead's KV is
        # there, its prompt a prefix-cache hit (the last block is computed again).
        self.lead = lead
        self.siblings: list[Leg] = []
        if lead is not None:
            lead.siblings.append(self)
        self._offered = False  # this lead has offered its handoff to its siblings
        self._shared: str | None = None  # a sibling: the decode worker where the lead's handoff is to be pulled
        self._pulling: Any = None  # a sibling: its decode_stream() of that handoff, submitted by the lead
        self.kv_ready = asyncio.Event()  # set once this leg's prompt KV is on `kv_on`, or it never will be
        self.kv_on: str | None = None
        self.request_id = request_id
        self.ids = ids
        self.params = params  # vLLM SamplingParams, n=1
        self.route = route
        self.deadline = deadline
        self.decision: RouteDecision | None = None
        self.transfer: TransferTelemetry | None = None  # the latest KV pull's, as its decode worker reported it
        self.attempts = 0  # workers tried (a retry or migration is one more)
        self.prefill_s: float | None = None  # the prefill worker's own time for the latest remote prefill
        self.routed_at = 0.0
        self.first_token_at: float | None = None
        self.tokens = 0
        self.done = False  # the last output (finished) has arrived
        self._admitting: asyncio.Future[RouteDecision] | None = None
        self._refs: set[Any] = set()  # ObjectRefs and ObjectRefGenerators in flight
        self._unpulled: tuple[Any, KVHandoff] | None = None  # (decode handle, handoff) not yet pulled
        self._prefilling: tuple[Any, str | None] | None = None  # (ObjectRef, decode worker) of a prefill
        self._closed = False  # close() ran: nothing new may start (the client may be gone)
        self._late_release = False  # close() will release the KV of a prefill it cancelled, if it finished

    # ---- admission -------------------------------------------------------------------------------
    def admit(self) -> asyncio.Future[RouteDecision]:
        """The first routing decision (idempotent). Raises ServeError (429/503) when refused. A sibling is
        admitted with its lead, onto the lead's decode worker."""
        if self._admitting is None:
            self._admitting = asyncio.ensure_future(
                self.svc.admission.route(self.route) if self.lead is None else self._beside_lead())
        return self._admitting

    async def _beside_lead(self) -> RouteDecision:
        dec = await self.lead.admit()  # type: ignore[union-attr]
        return dec._replace(prefill=None, local=True, placement="local:sibling", corrections=None)

    async def _lead_kv(self, dec: RouteDecision) -> RouteDecision:
        """Wait (within the deadline) until the lead's KV is on its decode worker; if it never gets there
        (the lead failed, moved, or ended at its first token), this sibling is routed on its own."""
        lead = self.lead
        assert lead is not None
        try:
            await asyncio.wait_for(lead.kv_ready.wait(), timeout=max(self._left(), 0.001))
        except TimeoutError:
            raise workers.timed_out("request", self.svc.cfg.serve.request_timeout_s) from None
        if self._shared is not None:  # NOTE: the lead's prefill, pulled by this sibling itself
            return dec._replace(prefill=lead.decision.prefill if lead.decision else None, decode=self._shared,
                                local=False, placement="remote:sibling")
        if lead.kv_on is not None and lead.kv_on == dec.decode and self.svc.members.handle(dec.decode) is not None:
            return dec
        self.lead = None
        return await self.svc.admission.route(self.route, must_admit=True)

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    # ---- running ---------------------------------------------------------------------------------
    async def outputs(self) -> AsyncIterator[Any]:
        """DELTA RequestOutputs of this completion (raw from the workers, prompt logprobs attached)."""
        try:
            async for out in self._outputs():
                yield out
        finally:
            # NOTE: ended (done, failed, or over at its first token, before any decode held its KV): siblings
            # waiting on it stop waiting; without a landing (kv_on) they are routed on their own.
            self.kv_ready.set()

    async def _outputs(self) -> AsyncIterator[Any]:
        produced: list[int] = []
        excluded: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            left = self.params.max_tokens - len(produced)
            if left < 1:
                return
            prompt = self.ids + produced
            p = self.params.clone()
            p.max_tokens, p.min_tokens = left, max(0, p.min_tokens - len(produced))
            if produced:
                p.prompt_logprobs = None  # NOTE: delivered with the first output already
            route = self.route._replace(prompt_tokens=len(prompt), max_tokens=left)
            if attempt == 0:
                dec = await self.admit()
                if self.lead is not None:
                    dec = await self._lead_kv(dec)
            else:
                dec = await self.svc.admission.route(route, excluded, must_admit=True)
            self.decision, self.routed_at = dec, time.monotonic()
            self.attempts = attempt + 1
            if self.svc.cfg.mode != "colocated":
                where, _, why = (dec.placement or ("local:policy" if dec.local else "remote:policy")).partition(":")
                self.svc.metrics.placement.labels(where, why).inc()
            rid = self.request_id if attempt == 0 else f"{self.request_id}-r{attempt}"
            predicted = self.lead is None  # NOTE: the router predicted this leg; a sibling rides on its lead's
            try:
                async for out in self._attempt(rid, prompt, p, dec):
                    n = len(out.outputs[0].token_ids) if out.outputs else 0
                    if n and self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                        if predicted:
                            self.svc.admission.policy.observe_first_token(dec, self.route,
                                                                          self.first_token_at - self.routed_at)
                    if n and (dec.local or self.svc.cfg.mode == "colocated"):
                        self._kv_landed(dec.decode)  # NOTE: the prompt was prefilled there
                    self.tokens += n
                    produced.extend(out.outputs[0].token_ids if out.outputs else ())
                    yield out
                if predicted:
                    self._observe()
                return
            except WorkerDied as e:
                logger.warning("worker %s died serving %s after %d tokens (attempt %d): %s", e.worker, rid,
                               len(produced), attempt + 1, e.cause)
                if produced and not _movable(self.params):
                    raise unavailable(f"the decode worker serving this request was lost after {len(produced)} "
                                      "tokens, and its sampling state (structured output, penalties or seed) "
                                      "cannot move to another worker; retry the request") from None
                self.svc.metrics.requests.labels("migrated" if produced else "retried").inc()
                excluded.add(e.worker)
                self.svc.members.mark_unhealthy(e.worker)
        raise unavailable(f"request failed on {MAX_ATTEMPTS} workers in a row; retry later")

    def _observe(self) -> None:
        dec = self.decision
        if dec is None or self.first_token_at is None:
            return
        now = time.monotonic()
        ttft = self.first_token_at - self.routed_at
        tpot = (now - self.first_token_at) / (self.tokens - 1) if self.tokens > 1 else None
        self.svc.admission.policy.observe(dec, self.route, ttft, tpot)

    def _handle(self, worker: str | None) -> Any:
        h = self.svc.members.handle(worker) if worker else None
        if h is None:  # NOTE: replaced between routing and now; a retry routes again
            raise WorkerDied(str(worker), RuntimeError("worker left the pool"))
        return h

    async def _attempt(self, rid: str, ids: list[int], params: Any, dec: RouteDecision) -> AsyncIterator[Any]:
        sc = self.svc.cfg.serve
        if self._shared is not None:  # NOTE: a sibling: decode samples token 1 from the lead's pulled prompt
            worker, self._shared = self._shared, None
            if self._unpulled is None:  # closed meanwhile: close() released this reader's share
                return
            handle, handoff = self._unpulled
            gen, self._pulling = self._pulling, None
            async for out in self._decode(worker, handle, rid, ids, params, handoff, None, ids, gen):
                yield out
            return
        if self.svc.cfg.mode == "colocated" or dec.local or params.max_tokens == 1:
            # NOTE: one engine runs it all: colocated mode, a local prefill on the decode worker the router
            # chose, or a single token (the prefill worker alone).
            wid = dec.prefill if self.svc.cfg.mode != "colocated" and not dec.local else dec.decode
            gen = workers.generate(self._handle(wid), rid, ids, params)
            async for out in self._stream(gen, wid, sc.token_timeout_s):
                yield out
            return
        carry = first_token_carries(params)
        pre = await self._prefill(dec.prefill, rid, ids, params, dec.decode, carry)
        self.svc.metrics.prefill.observe(pre.handoff.prefill_s)
        self.prefill_s = pre.handoff.prefill_s
        handle = self._handle(dec.decode)
        handoff = self._offer_siblings(dec.decode, handle, pre.handoff)
        first = pre.output
        c = first.outputs[0]
        dec_ids, dec_params = ids, params
        if carry and c.token_ids and c.text:
            # NOTE: the client gets the prefill engine's first token now; the decode engine continues from
            # prompt + that token (its pull capped at what the prefill computed: kvtransfer/connector.py).
            if c.finish_reason == "length":  # our one-token cap, not the request's end
                c.finish_reason, c.stop_reason, first.finished = None, None, False
            first.num_cached_tokens = pre.handoff.cached_tokens
            yield first
            if first.finished:  # EOS or a stop token: nothing left for a decode engine
                asyncio.ensure_future(workers.release(handle, handoff))
                return
            dec_ids = ids + list(c.token_ids)
            dec_params = params.clone()
            dec_params.max_tokens = params.max_tokens - len(c.token_ids)
            dec_params.min_tokens = max(0, params.min_tokens - len(c.token_ids))
            dec_params.prompt_logprobs = None
            first = None
        if self._closed:  # NOTE: the client hung up on the prefill's first token before the decode started:
            if not self._late_release:  # close() found nothing to stop, so the KV is released here
                asyncio.ensure_future(workers.release(handle, handoff))
            return
        async for item in self._decode(dec.decode, handle, rid, dec_ids, dec_params, handoff, first, ids):
            yield item

    def _offer_siblings(self, worker: str | None, handle: Any, h: KVHandoff) -> KVHandoff:
        """Once, on this lead's first handoff: the handoff as every waiting sibling pulls it too (one reader
        each, counted in the handoff). Returns the handoff this leg pulls or releases."""
        if self._offered or not self.siblings:
            return h
        self._offered = True
        shared = dataclasses.replace(h, readers=1 + len(self.siblings))
        for s in self.siblings:
            if s._closed:  # NOTE: a reader that will never pull still notifies once, or the blocks wait for the lease
                asyncio.ensure_future(workers.release(handle, shared))
            else:  # NOTE: submitted here, in one burst with this leg's own, so the decode engine takes all
                # the pulls in one step; each sibling's task streams its own
                s._unpulled, s._shared = (handle, shared), worker
                s._pulling = workers.decode(handle, s.request_id, s.ids, s.params, shared)
                s._refs.add(s._pulling)
        self.kv_ready.set()  # NOTE: the siblings stop waiting; they pull this handoff themselves
        return shared

    async def _decode(self, worker: str | None, handle: Any, rid: str, dec_ids: list[int], dec_params: Any,
                      handoff: KVHandoff, first: Any, ids: list[int], gen: Any = None) -> AsyncIterator[Any]:
        """decode_stream() of `handoff` on `worker`: its TransferTelemetry recorded, its outputs yielded
        (`first`: the prefill's output whose prompt logprobs the first decode output carries; `gen`: that
        call when already submitted)."""
        sc = self.svc.cfg.serve
        self._unpulled = (handle, handoff)
        if gen is None:
            gen = workers.decode(handle, rid, dec_ids, dec_params, handoff)
        async for item in self._stream(gen, worker, self.svc.cfg.transfer.transfer_timeout_s + sc.token_timeout_s,
                                       first_timeout=True):
            if isinstance(item, TransferTelemetry):
                self._unpulled = None
                self.transfer = item
                self.svc.transfers.record(item)
                if item.outcome != "failed":  # NOTE: pulled, or recomputed there: the prompt's KV is on it
                    self._kv_landed(worker)
                continue
            if first is not None:  # NOTE: the decode engine sampled token 1 itself (regenerate path)
                item.prompt_logprobs = first.prompt_logprobs
                first = None
            # NOTE: the decode engine counts the prompt it loaded over NIXL as "cached"; the client's
            # cached-token count is the prefill engine's prefix-cache hit, as on one engine.
            item.num_cached_tokens = handoff.cached_tokens
            item.prompt_token_ids = ids
            yield item

    async def _prefill(self, worker: str | None, rid: str, ids: list[int], params: Any, decode: str | None,
                       sample_first: bool) -> Any:
        ref = workers.prefill(self._handle(worker), rid, ids, params, sample_first)
        # NOTE: until the result is here, close() cancels the task and releases a handoff that raced it.
        self._prefilling = (ref, decode)
        result = await workers.prefill_result(ref, worker, self._left(), self.svc.cfg.serve.request_timeout_s)
        self._prefilling = None
        return result

    async def _stream(self, gen: Any, worker: str | None, timeout: float,
                      first_timeout: bool = False) -> AsyncIterator[Any]:
        """Items of a streaming actor call, each within `timeout` (the first within `timeout` too, then
        serve.token_timeout_s when `first_timeout`) and all within the deadline."""
        if self._closed:  # NOTE: started after close() (the client is gone): stopped at once
            workers.cancel(gen)
            return
        self._refs.add(gen)
        sc = self.svc.cfg.serve
        try:
            async for item in workers.events(gen, worker, timeout, self._left, sc.request_timeout_s,
                                             sc.token_timeout_s, first_timeout):
                yield item
        finally:
            self._refs.discard(gen)
            workers.cancel(gen)

    def _kv_landed(self, worker: str | None) -> None:
        if not self.kv_ready.is_set():
            self.kv_on = worker
            self.kv_ready.set()

    # ---- cleanup ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop everything in flight; safe to call more than once and from a cancelled task."""
        self._closed = True
        self.kv_ready.set()  # NOTE: siblings waiting on this leg's KV stop waiting (kv_on stays as it was)
        if self._admitting is not None and not self._admitting.done():
            self._admitting.cancel()
        for ref in list(self._refs):
            workers.cancel(ref)
        self._refs.clear()
        if self._prefilling is not None:
            ref, decode = self._prefilling
            self._prefilling = None
            workers.cancel(ref)
            handle = self.svc.members.handle(decode) if decode else None
            if handle is not None:
                self._late_release = True
                asyncio.ensure_future(workers.release_late(ref, handle))
        if self._unpulled is not None:
            handle, handoff = self._unpulled
            self._unpulled = None
            asyncio.ensure_future(workers.release(handle, handoff))

