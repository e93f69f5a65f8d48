"""The prefill worker: runs a prompt to its first token and hands its KV cache to a decode worker."""

from __future__ import annotations

import time
from typing import Any

from engine.host import EngineError, EngineHost, delta, sampling_params
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

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]) -> dict:
        """Return ``{"first": delta, "handoff": KVHandoff dict}``. The prompt's KV stays pinned here until
        the decode worker pulls it or the lease (TransferConfig.kv_lease_s) runs out."""
        t0 = time.monotonic()
        p = dict(params, max_tokens=1, min_tokens=0)
        last = None
        async for out in self._generate(request_id, prompt_token_ids, sampling_params(
                p, kv_transfer_params=dict(_REMOTE_DECODE))):
            last = out
        if last is None or not last.finished:
            raise EngineError(f"prefill of {request_id} ended without output")
        kvp = last.kv_transfer_params
        if not kvp or not kvp.get("remote_block_ids"):
            raise EngineError(f"prefill of {request_id} returned no KV handoff (kv_transfer_params={kvp})")
        first = delta(last)
        handoff = KVHandoff(
            request_id=request_id,
            prefill_worker=self.worker_id,
            prefill_engine_id=self.engine_id,
            prompt_tokens=len(prompt_token_ids),
            kv_transfer_params=dict(kvp),
            block_bytes=self.block_bytes,
            block_size=self.block_size,
            first_token_id=first["token_ids"][0] if first["token_ids"] else None,
            prefill_s=time.monotonic() - t0,
            created_at=time.time(),
            backend=",".join(backend_list(self.transfer_cfg)),
            memory="DRAM" if self.device == "cpu" else "VRAM",
        )
        return {"first": first, "handoff": handoff.to_dict()}
