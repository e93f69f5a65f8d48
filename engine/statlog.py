"""A vLLM stat logger that keeps the latest scheduler numbers and KV-connector totals in memory."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvtransfer.connector import LOAD_STARTED
from kvtransfer.integrity import MISMATCH

# NOTE: step times older than this were measured on another batch (the router compares them with the
# model at the batch running now), so stats() leaves them out.
STEP_WINDOW_S = 3.0
MAX_LOADS_KEPT = 4096  # load-start times kept (a decode worker reads its request's within seconds)


def _ours(engine_request_id: str) -> str:
    # NOTE: vLLM's engine id is ours plus "-" and 8 random characters (InputProcessor.assign_request_id)
    return engine_request_id[:-9] if engine_request_id[-9:-8] == "-" else engine_request_id


def _keep(d: OrderedDict[str, Any], rid: str, value: Any) -> None:
    d[rid] = value
    while len(d) > MAX_LOADS_KEPT:
        d.popitem(last=False)


class EngineTotals:
    """Running totals, shared between the stat logger (writer) and the worker (reader)."""

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.step_times: deque[tuple[float, float]] = deque(maxlen=32)  # (ended at, duration), monotonic
        self.last_step_at = 0.0
        self.busy = False  # whether the engine still had requests after its latest step
        self.kv_transfers = 0
        self.kv_bytes = 0
        self.kv_transfer_s = 0.0
        self.kv_failures = 0
        self.kv_expired = 0
        self.kv_late_reads = 0  # prefill side: a decode said it read blocks already freed (expired or over-counted)
        self.prompt_tokens_computed = 0
        self.prompt_tokens_external = 0
        self.spec_drafted = 0  # speculative decoding: draft tokens proposed, and accepted
        self.spec_accepted = 0
        self.loads_started: OrderedDict[str, float] = OrderedDict()  # request id -> monotonic time
        self.kv_mismatches = 0  # decode side: pulls whose blocks differed from the prefill's digest
        self.mismatched: OrderedDict[str, tuple[float, int]] = OrderedDict()  # rid -> (monotonic, blocks redone)

    def load_started_at(self, request_id: str, since: float = 0.0) -> float | None:
        """When the engine's scheduler started pulling `request_id`'s KV (kvtransfer/connector.py), if it has
        since `since` (monotonic; an older entry is an earlier request of the same id)."""
        at = self.loads_started.get(request_id)
        return at if at is not None and at >= since else None

    def _load_started(self, engine_request_id: str, at: float) -> None:
        _keep(self.loads_started, _ours(engine_request_id), at)

    def mismatched_since(self, request_id: str, since: float = 0.0) -> int:
        """Blocks recomputed because the KV pulled for `request_id` (since `since`) failed the integrity
        check (from the first bad block to the end); 0 if it passed or was not checked."""
        at, blocks = self.mismatched.get(request_id, (0.0, 0))
        return blocks if at >= since else 0

    def recent_steps(self, window_s: float = STEP_WINDOW_S) -> tuple[float, ...]:
        """Durations of the steps that ended within the last `window_s`: older ones ran another batch."""
        cut = time.monotonic() - window_s
        return tuple(dt for end, dt in self.step_times if end >= cut)

    def snapshot(self) -> dict[str, Any]:
        return {
            "kv_transfers": self.kv_transfers,
            "kv_bytes": self.kv_bytes,
            "kv_transfer_s": self.kv_transfer_s,
            "kv_failures": self.kv_failures,
            "kv_expired": self.kv_expired,
            "kv_late_reads": self.kv_late_reads,
            "kv_integrity_mismatches": self.kv_mismatches,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_external": self.prompt_tokens_external,
            "spec_drafted": self.spec_drafted,
            "spec_accepted": self.spec_accepted,
        }


def make_stat_logger_factory(totals: EngineTotals):
    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.totals = totals

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            t = self.totals
            now = time.monotonic()
            was_busy = t.busy
            if scheduler_stats is not None:
                t.waiting = scheduler_stats.num_waiting_reqs
                t.running = scheduler_stats.num_running_reqs
                t.kv_usage = float(scheduler_stats.kv_cache_usage)
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                if spec is not None:
                    t.spec_drafted += spec.num_draft_tokens
                    t.spec_accepted += spec.num_accepted_tokens
                kv = scheduler_stats.kv_connector_stats or {}
                data = kv.get("NixlConnector", kv) if isinstance(kv, dict) else {}
                if isinstance(data, dict):
                    data = data.get("data", data)
                    t.kv_transfers += len(data.get("bytes_transferred", []))
                    t.kv_bytes += int(sum(data.get("bytes_transferred", [])))
                    t.kv_transfer_s += float(sum(data.get("transfer_duration", [])))
                    t.kv_failures += len(data.get("num_failed_transfers", [])) + len(
                        data.get("num_failed_handshakes", [])
                    )
                    t.kv_expired += len(data.get("num_kv_expired_reqs", []))
                    t.kv_late_reads += len(data.get("num_notifications_after_expiry", []))
                    for rid in data.get(LOAD_STARTED, ()):
                        t._load_started(rid, now)
                    for rid, blocks in data.get(MISMATCH, ()):
                        t.kv_mismatches += 1
                        _keep(t.mismatched, _ours(rid), (now, int(blocks)))
            if iteration_stats is not None:
                pts = iteration_stats.prompt_token_stats
                t.prompt_tokens_computed += pts.computed
                t.prompt_tokens_external += pts.external_kv_transfer
                # NOTE: after an idle engine the gap since its last step is idle time, not a step.
                if t.last_step_at and was_busy and (iteration_stats.num_generation_tokens or pts.total):
                    t.step_times.append((now, now - t.last_step_at))
                t.last_step_at = now
            if scheduler_stats is not None:
                t.busy = bool(scheduler_stats.num_running_reqs or scheduler_stats.num_waiting_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return _Logger
