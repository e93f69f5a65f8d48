"""The prefill worker: runs a prompt to its first token and hands its KV cache to a decode worker."""

from __future__ import annotations

import time
from typing import Any

from engine.contract import PrefillResult
from engine.host import EngineError, EngineHost, delta_params
from kvtransfer.config import backend_list
from kvtransfer.handoff import KVHandoff

# NOTE: the connector fills these in when the prefill finishes; this is the "please keep my blocks for a
# remote decode" request recorded in vLLM's P/D protocol.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PrefillWorker(EngineHost):
    role = "prefill"

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: Any,
                      sample_first: bool = True) -> PrefillResult:
        """Run the prompt to one token with vLLM ``SamplingParams`` ``params`` (n=1). The prompt's KV stays
        pinned here until the decode worker pulls it, it is released, or the lease
        (TransferConfig.kv_lease_s) runs out.

        ``sample_first``: the first token is the client's (sampled with the request's own parameters and
        logprobs; EOS only once min_tokens allows). Otherwise the decode engine samples it again and only the
        prompt logprobs (computed here, where the prompt runs) are wanted from this leg."""
        t0 = time.monotonic()
        extra = dict(params.extra_args or {}, kv_transfer_params=dict(_REMOTE_DECODE))
        if sample_first:
            p = delta_params(params, max_tokens=1, min_tokens=min(1, params.min_tokens), n=1, extra_args=extra)
        else:
            p = delta_params(params, max_tokens=1, min_tokens=0, n=1, structured_outputs=None, logprobs=None,
                             extra_args=extra)
        last = None
        async for out in self._generate(request_id, prompt_token_ids, p):
            last = out if last is None else _merged(last, out)
        if last is None or not last.finished:
            raise EngineError(f"prefill of {request_id} ended without output")
        kvp = last.kv_transfer_params
        if not kvp or not kvp.get("remote_block_ids"):
            raise EngineError(f"prefill of {request_id} returned no KV handoff (kv_transfer_params={kvp})")
        first = last.outputs[0].token_ids
        handoff = KVHandoff(
            request_id=request_id,
            prefill_worker=self.worker_id,
            prefill_engine_id=self.engine_id,
            prompt_tokens=len(prompt_token_ids),
            kv_transfer_params=dict(kvp),
            block_bytes=self.block_bytes,
            block_size=self.block_size,
            first_token_id=first[0] if first else None,
            prefill_s=time.monotonic() - t0,
            created_at=time.time(),
            backend=",".join(backend_list(self.transfer_cfg)),
            memory="DRAM" if self.device == "cpu" else "VRAM",
            node_id=self.node_id,
            cached_tokens=last.num_cached_tokens or 0,
        )
        last.kv_transfer_params = None
        return PrefillResult(last, handoff)


def _merged(a: Any, b: Any) -> Any:
    a.add(b, aggregate=True)
    if b.prompt_logprobs is not None:
        a.prompt_logprobs = b.prompt_logprobs
    return a
