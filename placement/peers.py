"""Each worker against its pool, for the planner loop (placement/replan.py).

The ingress files every finished request's TTFT under the worker that computed its prompt and its TPOT
under the worker that decoded it (`WorkerWindow`, inside each TrafficWindow). `PeerComparison` divides each
sample by its pool's median in the same window (same role), gathers a worker's quotients until there are
MIN_WORKER_SAMPLES of a kind, and moves the worker's ratio (EWMA in log space) by their median. Measured
against measured, not against a model: a pool of one reads 1.0, and an overloaded window (where the model's
correction learns nothing) still shows which worker lags. `drain_order` names the workers a shrink should
remove first: those SLOW_WORKER times slower than their pool, slowest first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

SLOW_WORKER = 1.2  # a worker this much slower than its pool's median is drained first on a shrink
MIN_WORKER_SAMPLES = 3  # per worker and kind, gathered over windows, before its ratio moves
WORKER_MEMORY = 20  # windows a worker that reports nothing stays listed


class WorkerWindow(NamedTuple):
    """What one worker served in an interval, as the ingress measured it."""

    worker: str
    role: str  # "prefill", "decode" or "colocated"
    ttft_s: tuple[float, ...] = ()  # of the prompts it computed (a decode worker: its local prefills)
    tpot_s: tuple[float, ...] = ()  # of the requests it decoded


class WorkerRatio(NamedTuple):
    """A worker against its pool: its TTFT (TPOT) over the pool's median, smoothed over windows (1.0: like
    its pool; None: not enough samples yet)."""

    worker: str
    role: str
    ttft: float | None
    tpot: float | None
    requests: int  # requests it reported (prompts computed or streams decoded) over the windows seen

    @property
    def slowness(self) -> float:
        return max(self.ttft or 1.0, self.tpot or 1.0)


def drain_order(workers: Sequence[WorkerRatio], role: str) -> list[str]:
    """Workers of `role` that a shrink should drain first: those at least SLOW_WORKER times slower than their
    pool (TTFT or TPOT), slowest first."""
    slow = [w for w in workers if w.role == role and w.slowness >= SLOW_WORKER]
    return [w.worker for w in sorted(slow, key=lambda w: -w.slowness)]


class _Peer:
    __slots__ = ("ratio", "requests", "seen", "pending")

    def __init__(self, seen: int) -> None:
        self.ratio: list[float | None] = [None, None]  # TTFT, TPOT
        self.requests = 0
        self.seen = seen  # the last window it reported in
        self.pending: tuple[list[float], list[float]] = ([], [])  # log quotients not yet applied


class PeerComparison:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha  # weight of a new median quotient (in log space)
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._n = 0

    def update(self, workers: Sequence[WorkerWindow]) -> None:
        """One window's samples. A worker absent for WORKER_MEMORY windows leaves the list (bounded)."""
        self._n += 1
        a = self.alpha
        for ww in workers:
            p = self._peers.setdefault((ww.worker, ww.role), _Peer(self._n))
            p.seen = self._n
            p.requests += max(len(ww.ttft_s), len(ww.tpot_s))
        for i, kind in enumerate(("ttft_s", "tpot_s")):
            pools: dict[str, list[float]] = {}
            for ww in workers:
                pools.setdefault(ww.role, []).extend(getattr(ww, kind))
            for ww in workers:
                xs, pool = [x for x in getattr(ww, kind) if x > 0], pools[ww.role]
                ref = float(np.median(pool)) if pool else 0.0
                if not xs or not ref > 0:
                    continue
                p = self._peers[(ww.worker, ww.role)]
                buf = p.pending[i]
                buf.extend(math.log(x / ref) for x in xs)
                if len(buf) < MIN_WORKER_SAMPLES:
                    continue
                q, old = float(np.median(buf)), p.ratio[i]
                p.ratio[i] = math.exp(q) if old is None else math.exp((1 - a) * math.log(old) + a * q)
                buf.clear()
        for k in [k for k, p in self._peers.items() if self._n - p.seen >= WORKER_MEMORY]:
            del self._peers[k]

    def ratios(self) -> tuple[WorkerRatio, ...]:
        def rnd(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return tuple(WorkerRatio(w, role, rnd(p.ratio[0]), rnd(p.ratio[1]), p.requests)
                     for (w, role), p in sorted(self._peers.items()))
