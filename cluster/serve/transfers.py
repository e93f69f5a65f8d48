"""Per-request KV transfer telemetry as the ingress keeps it: the last records for /v1/stats, and the
saaf_kv_* metrics."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

from cluster.serve.metrics import Metrics
from kvtransfer.handoff import TransferTelemetry


class TransferLog:
    def __init__(self, metrics: Metrics, keep: int = 256) -> None:
        self.metrics = metrics
        self._last: deque[TransferTelemetry] = deque(maxlen=keep)

    def record(self, tel: TransferTelemetry) -> None:
        self._last.append(tel)
        m = self.metrics
        m.transfer.observe(tel.transfer_wait_s)
        if tel.outcome == "ok":
            m.kv_bytes.inc(tel.kv_bytes)
        elif tel.outcome == "recomputed":
            m.recomputes.inc()
            m.kv_failures.inc()
        else:
            m.kv_failures.inc()
        if tel.integrity == "mismatch":
            m.kv_mismatches.inc()

    def records(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self._last]
