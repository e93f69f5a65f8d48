"""CPU contention: engines that share a node's cores slow each other while both run.

The latency model is calibrated on one engine at a time (engine/calibrate.py), with the ingress idle. When a
burst makes the router send prompts to a prefill engine and, as local prefills, to a decode engine on the
same 2-core box, both engines compute at once beside the ingress, and each runs slower than calibrated
(docs/benchmarks.md, the burst benchmark: TTFT 1.05-2.5x its prediction). A CPU engine's predicted prefill is
therefore scaled by

    factor = max(1, (own threads + busy threads of the other engines on its node + INGRESS_CORES) / cores)
             / max(1, (own threads + INGRESS_CORES) / cores)

which is 1 for an engine running alone (what calibration measured) and on any node with cores to spare.
GPU engines report no CPU threads and are never scaled. INGRESS_CORES is an assumption, not a measurement:
the ingress, Ray and the KV side channel take about one core while a burst is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from engine.contract import WorkerStats

INGRESS_CORES = 1.0


class Booked(Protocol):
    """What the policy has routed to a worker that its stats may not show yet (goodput_state.WorkerState)."""

    led: object
    inc: object
    q: int


def busy(s: WorkerStats, st: Booked | None) -> bool:
    """Computing now or about to: requests in the engine, or routes booked there since its stats."""
    return bool(s.running or s.waiting or s.pulling or (st is not None and (st.led or st.inc or st.q)))


def factors(workers: Iterable[WorkerStats], states: Mapping[str, Booked]) -> dict[str, float]:
    """{worker_id: factor} for the CPU engines among `workers` (others are absent: factor 1)."""
    cpu = [s for s in workers if s.cpu_threads and s.cpu_cores]
    on: dict[str, float] = {}
    mine: dict[str, float] = {}
    for s in cpu:
        if busy(s, states.get(s.worker_id)):
            on[s.node_id] = on.get(s.node_id, 0.0) + s.cpu_threads
            mine[s.worker_id] = s.cpu_threads
    out = {}
    for s in cpu:
        others = on.get(s.node_id, 0.0) - mine.get(s.worker_id, 0.0)
        if others > 0:
            alone = max(1.0, (s.cpu_threads + INGRESS_CORES) / s.cpu_cores)
            out[s.worker_id] = max(1.0, (s.cpu_threads + others + INGRESS_CORES) / s.cpu_cores) / alone
    return out
