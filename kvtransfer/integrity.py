"""KV integrity: a digest of each KV block as the prefill engine wrote it, checked by the decode engine after
its pull, so a request is never answered from wrong blocks (`transfer.integrity: true`).

- Prefill side: when a prompt finishes, the connector (kvtransfer/connector.py, scheduler side) hashes the
  blocks it hands off, every layer's K and V, one 8-byte BLAKE2b digest per block, and adds the list to
  the request's kv_transfer_params (`saaf_kv_digest`), which travel to the decode engine in the handoff.
- Decode side: when the pull of a request completes, the connector (worker side) hashes the blocks it
  received and compares them with the prefill's, aligned from the end (a local prefix-cache hit pulls only
  the tail, as vLLM pairs them). Mismatched blocks are reported to vLLM as blocks that failed to load,
  so its own `kv_load_failure_policy` applies: `recompute` (our `transfer.failure_policy` default)
  computes them again on the decode engine, `fail` ends the request with an error. Mismatches are
  counted per request (connector stats `saaf_kv_mismatch`: /v1/stats, /metrics, x-saaf-served).

Whole blocks are hashed, including the unused slots of a prompt's last block: NIXL copies whole blocks,
and nothing writes to either side's copy between the prefill's end and the decode's check (the prefill
engine pins the blocks for the lease; the decode engine schedules the request only after the check).

NOTE: the prefill side reads its KV cache from the scheduler side of the connector, which shares the
engine process with the worker only when the engine runs one worker in process (tensor and pipeline
parallel size 1, vLLM's `uni` executor). With more workers the digest is not computed and the decode side
has nothing to check: `integrity` in the telemetry then says `unchecked`.

Fault injection, for the tests and the integrity benchmark (`transfer.fault_injection: true` only): the
decode worker's `inject_kv_corruption(n)` marks its next `n` pulls (`saaf_corrupt` in their
kv_transfer_params), and the connector changes one element of each one's last received block before the
check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DIGEST = "saaf_kv_digest"  # kv_transfer_params key: the prefill's per-block digests (hex), in handoff order
MISMATCH = "saaf_kv_mismatch"  # connector stats key: [decode request id, blocks recomputed] of failed checks
CORRUPT = "saaf_corrupt"  # kv_transfer_params key (fault injection): corrupt this pull's last block
DIGEST_BYTES = 8


class _Local:
    """The KV cache of this engine process's worker, for the connector's scheduler side (same process)."""

    kv_caches: Mapping[str, Any] | None = None
    num_blocks = 0  # physical blocks of each layer's tensor
    per_logical = 1  # physical blocks per logical (scheduler) block

    def ready(self) -> bool:
        return self.kv_caches is not None and self.num_blocks > 0

    def digests(self, block_ids: Sequence[int]) -> list[str]:
        return block_digests(self.kv_caches, block_ids, self.num_blocks, self.per_logical)  # type: ignore[arg-type]

    def corrupt(self, block_id: int) -> None:
        corrupt_block(self.kv_caches, block_id, self.num_blocks, self.per_logical)  # type: ignore[arg-type]


LOCAL = _Local()


def register(kv_caches: Mapping[str, Any], num_blocks: int, per_logical: int) -> None:
    LOCAL.kv_caches, LOCAL.num_blocks, LOCAL.per_logical = kv_caches, int(num_blocks), max(1, int(per_logical))


def block_axis(shape: Sequence[int], num_blocks: int) -> int:
    """The axis of a per-layer KV tensor that indexes blocks: the first of axes 0-1 (K/V may come first)
    whose size is the engine's block count, else any axis of that size."""
    for axis in (0, 1):
        if len(shape) > axis and shape[axis] == num_blocks:
            return axis
    for axis, n in enumerate(shape):
        if n == num_blocks:
            return axis
    raise ValueError(f"no axis of size {num_blocks} (the engine's KV block count) in KV tensor shape {tuple(shape)}")


def _physical(block_ids: Iterable[int], per_logical: int) -> list[list[int]]:
    return [[b * per_logical + i for i in range(per_logical)] for b in block_ids]


def block_digests(kv_caches: Mapping[str, Any], block_ids: Sequence[int], num_blocks: int,
                  per_logical: int = 1) -> list[str]:
    """One hex digest per logical block id: every layer's bytes of that block, in the caches' layer order
    (the model's, the same on both engines)."""
    import torch

    hashes = [hashlib.blake2b(digest_size=DIGEST_BYTES) for _ in block_ids]
    groups = _physical(block_ids, per_logical)
    flat = [p for g in groups for p in g]
    if not flat:
        return []
    for t in kv_caches.values():
        axis = block_axis(t.shape, num_blocks)
        picked = t.index_select(axis, torch.tensor(flat, device=t.device)).movedim(axis, 0).contiguous().cpu()
        raw = picked.view(torch.uint8).reshape(len(flat), -1).numpy()
        for i, g in enumerate(groups):
            for j in range(len(g)):
                hashes[i].update(raw[i * per_logical + j].data)
    return [h.hexdigest() for h in hashes]


def mismatched(local_ids: Sequence[int], expected: Sequence[str], got: Sequence[str]) -> list[int]:
    """Local block ids whose digest differs from the prefill's, pairing both lists from the end."""
    n = min(len(local_ids), len(expected), len(got))
    pairs = zip(local_ids[len(local_ids) - n:], expected[len(expected) - n:], got[len(got) - n:], strict=True)
    return [b for b, want, have in pairs if want != have]


def corrupt_block(kv_caches: Mapping[str, Any], block_id: int, num_blocks: int, per_logical: int = 1) -> None:
    """Change the first element of logical block `block_id` in the first layer (fault injection)."""
    import torch

    t = next(iter(kv_caches.values()))
    idx = [0] * t.dim()
    idx[block_axis(t.shape, num_blocks)] = block_id * per_logical
    with torch.no_grad():
        t[tuple(idx)] += 1
