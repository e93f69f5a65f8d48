"""A decode worker's stats while a request pulls its prompt's KV over NIXL: the prompt holds KV there and joins
the batch, but nothing is prefilled for it, so it is no prefill queue for a prompt the router would prefill on
that worker (`disaggregation: auto`). Until 2026-12-06 the whole prompt counted as `queued_prompt_tokens`: a
local prefill routed then was predicted to wait behind prompts that were only being copied (a 256-token prompt
predicted at 1.0-2.6 s to its first token against ~0.55 s idle) and to stall the streams there as long, and was
declined."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from cluster.router import RouteRequest
from decode import worker as dw
from engine.contract import WorkerStats
from engine.statlog import EngineTotals
from kvtransfer.handoff import KVHandoff
from tests.unit.test_router_disaggregation import policy, prefill


class _Engine:
    """An AsyncLLM stand-in: each request's first output waits for `go` (the KV pull)."""

    errored = False

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=4096),
                                           cache_config=SimpleNamespace(enable_prefix_caching=False))

    async def generate(self, prompt, params, request_id):
        await self.go.wait()
        n = len(prompt["prompt_token_ids"])
        for i in range(params.max_tokens):
            yield SimpleNamespace(num_cached_tokens=n - 1, finished=i == params.max_tokens - 1,
                                  outputs=[SimpleNamespace(token_ids=[7], finish_reason=None)])

    async def abort(self, request_id):
        pass


def _worker() -> dw.DecodeWorker:
    w = dw.DecodeWorker.__new__(dw.DecodeWorker)  # NOTE: the worker's bookkeeping; a stand-in engine
    w.worker_id, w.role, w.node_id = "decode-0", "decode", "n1"
    w._pending, w._pulling, w._running_ctx = {}, {}, {}
    w.totals, w.engine = EngineTotals(), _Engine()
    w.num_gpu_blocks, w.block_size = 45, 128
    w.counters = {"transfers": 0, "kv_bytes": 0, "recomputes": 0, "failures": 0, "timeouts": 0, "lease_expired": 0}
    w.transfer_cfg = SimpleNamespace(failure_policy="recompute", transfer_timeout_s=5.0, kv_lease_s=30.0,
                                     integrity=False)
    return w


def _handoff(rid: str, prompt: int) -> KVHandoff:
    return KVHandoff(rid, "prefill-0", "prefill-0-x", prompt, {"do_remote_prefill": True, "remote_block_ids": [1, 2]},
                     4096, 128, first_token_id=7, created_at=time.time())


def test_a_prompt_being_pulled_is_no_prefill_queue_on_the_decode_worker() -> None:
    from vllm import SamplingParams

    async def scenario():
        w = _worker()
        params = SamplingParams(max_tokens=3)
        # NOTE: as the leg sends it: the client's 256-token prompt plus the first token the prefill sampled
        streams = [w.decode_stream(f"r{i}", list(range(257)), params, _handoff(f"r{i}", 256)) for i in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.05)
        during = w.stats()
        w.engine.go.set()
        await asyncio.gather(*firsts)
        for s in streams:
            async for _ in s:
                pass
        return during, w.stats()

    during, after = asyncio.run(scenario())
    assert during.waiting == 2 and during.pulling == 2 and during.pulling_tokens == 512, during
    assert during.queued_prompt_tokens == 2, during  # NOTE: the first token, which the decode engine computes
    assert after.waiting == after.pulling == after.pulling_tokens == after.queued_prompt_tokens == 0, after


def test_the_router_puts_a_local_prompt_behind_prompts_to_prefill_not_behind_pulls() -> None:
    now = time.time()
    idle = WorkerStats("d0", "decode", "n1", 0, 2, 0, 600, 0.1, 5760, (), True, now)
    pulling = idle._replace(waiting=2, queued_prompt_tokens=2, pulling=2, pulling_tokens=512)
    queued = idle._replace(waiting=2, queued_prompt_tokens=514)  # NOTE: two prompts this engine must prefill
    req = RouteRequest(256, 32, 2.0, 0.15)
    ttft = {k: policy("never")(req, prefill(), [s]).predicted_ttft_s for k, s in
            (("idle", idle), ("pulling", pulling), ("queued", queued))}
    assert ttft["pulling"] < 1.05 * ttft["idle"], ttft
    assert ttft["queued"] > 1.8 * ttft["idle"], ttft
