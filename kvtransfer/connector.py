"""vLLM's NixlConnector with the decode side's pull capped at what the prefill engine computed.

Loaded by name through `kv_connector_module_path` (kvtransfer/config.py), so vLLM's own checks for
"NixlConnector" still apply to it.

NOTE: when the decode engine continues from prompt + the first token the prefill engine already sampled,
its request is one token longer than the prefill's. vLLM's connector sizes the pull from the decode
request's own prompt length: for a prompt of an exact multiple of the block size it then allocates one
block more than the prefill sent, and the worker's pairing of local and remote blocks raises ("Decode
allocated more KV pages than the prefill worker supplied"), which kills the decode EngineCore. The prefill
reports how many tokens it computed (`remote_num_tokens`); we never ask for more. The decode engine then
computes the first token's KV itself, as it computes the last prompt token's when nothing is appended.

It also reports, in the scheduler's KV-connector stats, which requests began pulling their KV this step
(`LOAD_STARTED`): the decode worker's transfer timeout runs from that moment, not from when the request
joined the decode engine's queue (engine/statlog.py reads it, decode/worker.py waits on it).

One prefill's KV can be pulled by several decode requests (the n completions of one prompt, each sampling
its own first token from the pulled prompt): the handoff says how many (`saaf_readers`), and every reader's
"done reading" notification reports that many consumers, so the prefill engine keeps the blocks until the
last reader has pulled (vLLM frees them at the first reader's notification otherwise). A reader that never
pulls still notifies once: vLLM's rejected-request path sends the same message.

Its handshake side channel drops malformed requests instead of dying on one (kvtransfer/side_channel.py).

With `saaf_integrity` in its extra config (`transfer.integrity: true`), the prefill side adds a digest of
every block it hands off and the decode side checks the blocks it pulled against it, reporting mismatched
blocks to vLLM as failed loads (kvtransfer/integrity.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as _VllmNixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvtransfer import integrity, side_channel
from kvtransfer.handoff import READERS

logger = logging.getLogger(__name__)
LOAD_STARTED = "saaf_load_started"  # engine request ids whose KV pull the scheduler started this step
READERS_KEPT = 4096  # worker side: reader counts remembered (a request's reads are posted within a few steps)


def capped_match(count: int | None, load_async: bool, params: dict[str, Any] | None,
                 num_computed_tokens: int) -> tuple[int | None, bool]:
    """Cap a remote-prefill match at the prefill engine's `remote_num_tokens` (pure, for tests)."""
    if not load_async or not count or not params or not params.get("do_remote_prefill"):
        return count, load_async
    remote = params.get("remote_num_tokens")
    if not remote:
        return count, load_async
    capped = min(count, int(remote) - num_computed_tokens)
    if capped <= 0:  # NOTE: the local prefix cache holds all the prefill computed: nothing to pull
        return 0, False
    return capped, True


class LoadStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus LOAD_STARTED. Every key of vLLM's stays (its Prometheus logger reads them)."""

    def reset(self) -> None:
        super().reset()
        self.data[LOAD_STARTED] = []
        self.data[integrity.MISMATCH] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not self.data.get(LOAD_STARTED) and not self.data.get(integrity.MISMATCH)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():  # NOTE: either side may lack LOAD_STARTED (vLLM's own stats class)
            self.data.setdefault(k, []).extend(v)
        return self


def as_load_stats(stats: KVConnectorStats | None, started: list[str],
                  mismatched: list[list] | None = None) -> LoadStats | None:
    """`stats` (vLLM's, or None) as LoadStats with `started` (and the integrity check's `mismatched`)
    added; None when there is nothing to report."""
    if stats is None and not started and not mismatched:
        return None
    out = LoadStats()
    if stats is not None:
        out.aggregate(stats)
    out.data[LOAD_STARTED].extend(started)
    out.data[integrity.MISMATCH].extend(mismatched or ())
    return out


def _trim(d: OrderedDict, keep: int = READERS_KEPT) -> None:
    while len(d) > keep:
        d.popitem(last=False)


class NixlConnector(_VllmNixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        side_channel.harden(self.connector_scheduler)  # NOTE: before vLLM starts its listener (set_xfer_handshake_metadata)
        self._started: list[str] = []  # scheduler side: loads started since the last stats
        ktc = getattr(self, "_kv_transfer_config", None)  # NOTE: set by vLLM's base class
        extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
        self._integrity = bool(extra.get("saaf_integrity"))
        self._faults = bool(extra.get("saaf_fault_injection"))
        # worker side: rid -> (local block ids, the prefill's digests or None, corrupt it first)
        self._expect: OrderedDict[str, tuple[list[int], list[str] | None, bool]] = OrderedDict()
        self._mismatched: list[list] = []  # worker side: [decode request id, blocks recomputed] of failed checks
        self._unchecked_logged = False
        self._readers: OrderedDict[str, int] = OrderedDict()  # worker side: decode request id -> readers
        worker = getattr(self, "connector_worker", None)  # NOTE: set by vLLM's init (None on the scheduler side)
        if worker is not None:
            read = worker._read_blocks

            def _read_blocks(**kw: Any) -> bool:  # NOTE: vLLM calls it with keywords only
                kw["expected_consumers"] *= self._readers.get(kw["request_id"], 1)
                return read(**kw)

            worker._read_blocks = _read_blocks

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        pending = self.connector_scheduler._reqs_need_recv  # type: ignore[union-attr]
        readers = {rid: n for rid, (req, *_) in pending.items()
                   if (n := int((req.kv_transfer_params or {}).get(READERS, 1))) > 1}
        # NOTE: digests cover whole blocks, all heads: a decode engine of another TP size holds other slices
        vc = getattr(self, "_vllm_config", None)
        tp = vc.parallel_config.tensor_parallel_size if vc is not None else 1
        checks = {rid: (p.get(integrity.DIGEST) if self._integrity and p.get("tp_size", 1) == tp else None,
                        self._faults and bool(p.get(integrity.CORRUPT)))
                  for rid, (req, *_) in pending.items() if (p := req.kv_transfer_params or {})}
        checks = {rid: c for rid, c in checks.items() if c[0] or c[1]}
        meta = super().build_connector_meta(scheduler_output)
        if readers:
            meta.saaf_readers = readers  # NOTE: travels with the metadata to the worker (start_load_kv)
        if checks:
            meta.saaf_checks = checks
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._readers.update(getattr(meta, "saaf_readers", None) or {})
        _trim(self._readers)
        for rid, (digests, corrupt) in (getattr(meta, "saaf_checks", None) or {}).items():
            req = meta.reqs_to_recv.get(rid)
            if req is not None and req.local_block_ids and req.local_block_ids[0]:
                self._expect[rid] = (list(req.local_block_ids[0]), digests, corrupt)
        _trim(self._expect)
        super().start_load_kv(forward_context, **kwargs)

    # ---- integrity (kvtransfer/integrity.py) -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        w = self.connector_worker
        per_logical = int(getattr(w, "_physical_blocks_per_logical_kv_block", 1) or 1)
        integrity.register(kv_caches, w.num_blocks, per_logical)  # type: ignore[union-attr]

    def _with_digest(self, result: tuple[bool, dict[str, Any] | None]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side, prefill engine: the handed-off blocks' digests added to the kv_transfer_params."""
        delay, params = result
        if not (self._integrity and delay and params and params.get("do_remote_prefill")):
            return result
        groups = params.get("remote_block_ids") or []
        if integrity.LOCAL.ready() and len(groups) == 1:
            params[integrity.DIGEST] = integrity.LOCAL.digests(list(groups[0]))
        elif not self._unchecked_logged:
            self._unchecked_logged = True
            logger.warning(
                "transfer.integrity: no digest (the KV cache is not in this engine process, or the model has "
                "several KV-cache groups): decode engines cannot check these transfers")
        return delay, params

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._with_digest(super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._with_digest(super().request_finished_all_groups(request, block_ids))

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        for rid in results.finished_recving:
            expected = self._expect.pop(rid, None)
            if expected is None or not integrity.LOCAL.ready():
                continue
            local, digests, corrupt = expected
            if corrupt:  # NOTE: fault injection (transfer.fault_injection): as if the fabric flipped a bit
                integrity.LOCAL.corrupt(local[-1])
                logger.warning("fault injection: corrupted a pulled KV block of %s", rid)
            if not digests:
                continue
            bad = integrity.mismatched(local, digests, integrity.LOCAL.digests(local))
            if bad:
                logger.warning(
                    "KV integrity: %d of %d pulled block(s) of %s differ from what the prefill engine wrote; "
                    "reported as failed loads (kv_load_failure_policy applies)", len(bad), len(local), rid)
                # NOTE: vLLM recomputes from the first bad block on; (rid, blocks from it to the end) tells the
                # decode worker how much (the request's cached-token count still counts the whole pull)
                self._mismatched.append([rid, len(local) - local.index(bad[0])])
                self.connector_worker._invalid_block_ids.put(set(bad))  # type: ignore[union-attr]
        return results

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return capped_match(count, load_async, request.kv_transfer_params, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and params.get("do_remote_prefill"):
            self._started.append(request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # NOTE: called on the scheduler side (no connector worker there: vLLM's part is None) and on the
        # worker side; both return LoadStats so that aggregating the two never meets a missing key.
        started, self._started = self._started, []
        mismatched, self._mismatched = self._mismatched, []
        return as_load_stats(super().get_kv_connector_stats(), started, mismatched)

