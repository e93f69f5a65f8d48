"""The decode worker: continues a request from a KV handoff, pulling the prompt's KV over NIXL, and
streams tokens. Enforces the transfer failure policy and reports per-request transfer telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine.contract import DecodeQueued
from engine.host import EngineError, EngineHost, delta_params
from kvtransfer.handoff import KVHandoff, TransferTelemetry
from kvtransfer.integrity import CORRUPT, DIGEST

if TYPE_CHECKING:
    from engine.contract import DecodeEvent

logger = logging.getLogger(__name__)
POLL_S = 0.05  # how often a handoff's wait checks whether its KV pull started
QUEUED_BEAT_S = 2.0  # how often a queued handoff tells the ingress it is still queued


def lease_margin_s(lease_s: float) -> float:
    """How long before its lease ends a handoff is no longer pulled: the request must reach the decode
    engine's scheduler (whose heartbeat then renews the lease) before the prefill engine frees the blocks,
    and one engine step can delay that."""
    return max(2.0, 0.2 * lease_s)


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has stopped (its generator may then be closed)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


class DecodeWorker(EngineHost):
    role = "decode"
    _corrupt_next = 0  # fault injection: pulls still to corrupt (transfer.fault_injection)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counters = {"transfers": 0, "kv_bytes": 0, "recomputes": 0, "failures": 0, "timeouts": 0,
                         "lease_expired": 0, "integrity_mismatches": 0}

    def inject_kv_corruption(self, n: int) -> int:
        """Tests only (transfer.fault_injection): the next `n` pulls get one element of a received block
        changed before the integrity check (kvtransfer/integrity.py). Returns how many are armed."""
        if not self.transfer_cfg.fault_injection:
            raise EngineError("fault injection is off on this deployment (transfer.fault_injection: false)")
        self._corrupt_next = max(0, int(n))
        return self._corrupt_next

    async def decode_stream(
        self, request_id: str, prompt_token_ids: list[int], params: Any, h: KVHandoff
    ) -> AsyncIterator[DecodeEvent]:
        """The first item is this request's TransferTelemetry, then DELTA RequestOutputs for vLLM
        ``SamplingParams`` ``params`` (n=1; prompt logprobs come from the prefill leg)."""
        submitted = time.monotonic()
        handoff_latency = max(0.0, time.time() - h.created_at) if h.created_at else 0.0
        policy = self.transfer_cfg.failure_policy
        timeout = self.transfer_cfg.transfer_timeout_s
        outcome = "ok"
        lease = float(self.transfer_cfg.kv_lease_s)
        if h.created_at and handoff_latency > lease - lease_margin_s(lease):
            # NOTE: past (or about to pass) its lease, the prefill engine has freed these blocks
            # and new prompts may have overwritten them: a pull would stream wrong output with a 200.
            self.counters["lease_expired"] += 1
            if policy == "fail":
                self.counters["failures"] += 1
                raise EngineError(f"KV handoff of {request_id} from {h.prefill_worker} arrived {handoff_latency:.1f}s "
                                  f"after its prefill, past its {lease:.0f}s lease (transfer.kv_lease_s)")
            logger.warning("handoff of %s arrived %.1fs after its prefill (lease %.0fs): recomputing on decode",
                           request_id, handoff_latency, lease)
            outcome = "recomputed"
            gen = self._generate(f"{request_id}-rc", prompt_token_ids, delta_params(params, prompt_logprobs=None))
        else:
            kv_params = h.decode_params()
            if self._corrupt_next > 0:
                self._corrupt_next -= 1
                kv_params[CORRUPT] = True
            extra = dict(params.extra_args or {}, kv_transfer_params=kv_params)
            gen = self._generate(request_id, prompt_token_ids, delta_params(params, prompt_logprobs=None,
                                                                             extra_args=extra),
                                 pulled=h.prompt_tokens)
        first_task = asyncio.ensure_future(anext(gen))
        try:
            async for waited in self._until_pulled(first_task, request_id, submitted, timeout):
                yield DecodeQueued(request_id, round(waited, 3))
            first = first_task.result()
        except TimeoutError:
            await _cancelled(first_task)
            await gen.aclose()
            self.counters["timeouts"] += 1
            if policy == "fail":
                self.counters["failures"] += 1
                raise EngineError(
                    f"KV transfer for {request_id} from {h.prefill_worker} timed out after {timeout:.0f}s"
                ) from None
            logger.warning("KV transfer for %s timed out; recomputing the prompt on decode", request_id)
            outcome = "recomputed"
            gen = self._generate(f"{request_id}-rc", prompt_token_ids, delta_params(params, prompt_logprobs=None))
            first = await anext(gen)
        except StopAsyncIteration:
            raise EngineError(f"decode of {request_id} ended without output") from None
        finally:
            if not first_task.done():
                first_task.cancel()
        started = self.totals.load_started_at(request_id, since=submitted)
        loaded = first.num_cached_tokens or 0
        computed = max(0, len(prompt_token_ids) - loaded)
        if first.outputs[0].finish_reason == "error":
            self.counters["failures"] += 1
            outcome = "failed"
        elif outcome == "ok" and computed > 1:
            # NOTE: decode always recomputes the last prompt token to sample from it; more than that
            # means the transfer did not deliver (vLLM's recompute policy, or a threshold skip).
            outcome = "recomputed"
        checked = ""
        if self.transfer_cfg.integrity:
            redone = self.totals.mismatched_since(request_id, submitted)
            if redone:  # NOTE: vLLM recomputed from its first bad block on (or, policy fail, failed it)
                checked = "mismatch"
                self.counters["integrity_mismatches"] += 1
                computed = max(computed, len(prompt_token_ids) - (h.num_blocks - redone) * h.block_size)
                if outcome == "ok":
                    outcome = "recomputed"
            elif DIGEST in h.kv_transfer_params and outcome == "ok":
                checked = "ok"
            else:  # NOTE: no digest (a prefill engine of several workers), or nothing was pulled
                checked = "unchecked"
        if outcome == "recomputed":
            self.counters["recomputes"] += 1
        else:
            self.counters["transfers"] += 1
            self.counters["kv_bytes"] += h.kv_bytes
        tel = TransferTelemetry(
            request_id=request_id,
            prefill_worker=h.prefill_worker,
            decode_worker=self.worker_id,
            kv_blocks=h.num_blocks,
            kv_bytes=h.kv_bytes if outcome == "ok" else 0,
            prompt_tokens=h.prompt_tokens,  # NOTE: the client's prompt; the decode request may also hold the
            # first token the prefill engine sampled, whose KV the decode engine computes itself
            loaded_tokens=loaded,
            decode_computed_prompt_tokens=computed,
            transfer_wait_s=time.monotonic() - (started or submitted),
            decode_queue_s=(started - submitted) if started else 0.0,
            handoff_latency_s=handoff_latency,
            backend=h.backend,
            memory=h.memory,
            outcome=outcome,
            integrity=checked,
            prefill_tp=int(h.kv_transfer_params.get("tp_size") or 1),
            decode_tp=self.tp,
        )
        if outcome == "failed":
            await gen.aclose()
            raise EngineError(f"KV transfer for {request_id} from {h.prefill_worker} failed (policy: fail)")
        yield tel
        yield first
        async for out in gen:
            yield out

    async def _until_pulled(self, first: asyncio.Future, request_id: str, submitted: float, timeout: float
                            ) -> AsyncIterator[float]:
        """Wait for the decode engine's first output; every QUEUED_BEAT_S while the request is still queued
        there (its KV pull not started), yield the time waited so far. TimeoutError once the pull has run
        `timeout` seconds, or the engine made no step at all for `timeout` (hung).

        NOTE: the transfer timeout measures the transfer. Time queued on a busy decode engine is
        not a failed transfer (recomputing it there would add work where capacity is short); it is bounded
        by the request's own deadline at the ingress, which receives the beats."""
        beat = submitted
        while True:
            done, _ = await asyncio.wait({first}, timeout=POLL_S)
            if done:
                return
            now = time.monotonic()
            started = self.totals.load_started_at(request_id, since=submitted)
            if started is not None:
                if now - started > timeout:
                    raise TimeoutError
                continue
            if now - max(self.totals.last_step_at, submitted) > timeout:
                raise TimeoutError  # NOTE: no engine step since we submitted: the engine is stuck
            if now - beat >= QUEUED_BEAT_S:
                beat = now
                yield now - submitted

    async def release(self, h: KVHandoff) -> None:
        """Free a handoff's KV blocks on its prefill engine when no decode will pull them (the client left,
        or the request was re-routed): vLLM's connector tells the prefill engine it may free them."""
        await self.engine.notify_kv_transfer_request_rejected(f"{h.request_id}-release", h.decode_params())

    def transfer_counters(self) -> dict[str, Any]:
        return dict(self.counters, **self.totals.snapshot())
