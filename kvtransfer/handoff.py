"""The object passed from a prefill worker to a decode worker, and per-request transfer telemetry."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

READERS = "saaf_readers"  # kv_transfer_params key: how many decode requests pull one prefill's KV


@dataclass
class KVHandoff:
    """vLLM's kv_transfer_params plus our ids and telemetry. msgpack-serialisable via to_bytes()."""

    request_id: str
    prefill_worker: str
    prefill_engine_id: str
    prompt_tokens: int
    kv_transfer_params: dict[str, Any]
    block_bytes: int  # bytes of one KV block across all layers (K and V)
    block_size: int  # tokens per block
    first_token_id: int | None = None
    prefill_s: float = 0.0
    created_at: float = 0.0  # wall clock on the prefill worker when the handoff was made
    backend: str = "UCX"
    memory: str = "DRAM"
    node_id: str = ""  # Ray node of the prefill engine
    cached_tokens: int = 0  # prompt tokens the prefill engine found in its prefix cache
    readers: int = 1  # decode requests that pull this KV (the n completions of one prompt); see connector.py

    @property
    def num_blocks(self) -> int:
        ids = self.kv_transfer_params.get("remote_block_ids") or []
        # NOTE: vLLM passes one list per KV-cache group; plain attention models have exactly one.
        if ids and isinstance(ids[0], list | tuple):
            return sum(len(g) for g in ids)
        return len(ids)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def decode_params(self) -> dict[str, Any]:
        """The kv_transfer_params for the decode request."""
        params = dict(self.kv_transfer_params)
        # NOTE: when present, vLLM reports this prefill-side cache count as the decode request's cached
        # tokens, hiding what the decode engine really loaded; drop it so num_cached_tokens on decode
        # tells how many prompt tokens decode did not compute (the silent-recompute detector).
        params.pop("remote_prefill_cached_tokens", None)
        if self.readers > 1:
            params[READERS] = self.readers
        return params

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandoff:
        return cls(**msgpack.unpackb(data, raw=False, strict_map_key=False))


@dataclass
class TransferTelemetry:
    """What one request's KV transfer did, as seen by the decode worker."""

    request_id: str
    prefill_worker: str
    decode_worker: str
    kv_blocks: int
    kv_bytes: int
    prompt_tokens: int
    loaded_tokens: int  # prompt tokens decode did not compute (transferred or locally cached)
    decode_computed_prompt_tokens: int  # >0 on a pull means decode recomputed (failure or fallback)
    transfer_wait_s: float  # the decode engine starts the pull -> first decode output (pull + one step)
    handoff_latency_s: float  # prefill done -> decode submit
    backend: str
    memory: str
    outcome: str = "ok"  # ok | recomputed | failed
    extra: dict[str, Any] = field(default_factory=dict)
    decode_queue_s: float = 0.0  # decode submit -> the decode engine starts the pull (its queue)
    integrity: str = ""  # transfer.integrity: "ok", "mismatch" (blocks recomputed or request failed), "unchecked"
    prefill_tp: int = 1  # tensor-parallel ranks of the prefill engine the KV came from (each sent its heads)
    decode_tp: int = 1  # ... and of the decode engine that pulled it

    @property
    def recomputed(self) -> bool:
        return self.outcome == "recomputed"
