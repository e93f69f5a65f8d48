"""What this ingress replica saw, for the planner loop: arrivals with their prompt lengths, finished
requests with output lengths, TTFT, TPOT and prefix-cache hits, and the same TTFT and TPOT again by the
worker that computed the prompt and the one that decoded it. Reported to the PoolController every few
seconds as a typed TrafficWindow (placement.replan); the reply is the loop's latest decision, which this
replica exposes in /v1/stats and as saaf_planner_* metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from placement.peers import WorkerWindow
from placement.replan import TrafficWindow

logger = logging.getLogger(__name__)

SAMPLE_CAP = 2000  # per field per report: a reservoir sample beyond this
WORKER_CAP = 200  # per worker per field per report
MAX_WORKERS = 512  # workers tracked per report (bounded whatever the membership churn)
REPORT_TIMEOUT_S = 10.0
REPORT_EVERY_S = 5.0  # (or half the planner interval, if shorter)


class _Reservoir:
    def __init__(self, cap: int, rng: random.Random) -> None:
        self.cap, self.rng, self.seen, self.items = cap, rng, 0, []

    def add(self, v: float) -> None:
        self.seen += 1
        if len(self.items) < self.cap:
            self.items.append(v)
        else:
            j = self.rng.randrange(self.seen)
            if j < self.cap:
                self.items[j] = v


class TrafficLog:
    def __init__(self, cap: int = SAMPLE_CAP, seed: int = 0) -> None:
        self.cap = cap
        self._rng = random.Random(seed)
        self._reset(time.time())

    def _reset(self, now: float) -> None:
        self.start_s = now
        self.arrivals = 0
        self.prompt_tokens = self.cached_tokens = self.finished_n = self.local_n = 0
        self._fields = {k: _Reservoir(self.cap, self._rng)
                        for k in ("prompt_lens", "output_lens", "ttft_s", "tpot_s")}
        self._workers: dict[tuple[str, str], tuple[_Reservoir, _Reservoir]] = {}

    def _worker(self, worker: str, role: str) -> tuple[_Reservoir, _Reservoir] | None:
        k = (worker, role)
        if k not in self._workers and len(self._workers) < MAX_WORKERS:
            self._workers[k] = (_Reservoir(min(self.cap, WORKER_CAP), self._rng),
                                _Reservoir(min(self.cap, WORKER_CAP), self._rng))
        return self._workers.get(k)

    def arrival(self, prompt_len: int, n: int = 1) -> None:
        """A request reached the engine client (admitted or not: demand). `n` completions = n arrivals."""
        self.arrivals += n
        for _ in range(n):
            self._fields["prompt_lens"].add(prompt_len)

    def finished(self, prompt_len: int, output_lens: list[int], ttft_s: float, tpot_s: float,
                 cached_tokens: int, local: bool = False, prompt_by: Sequence[tuple[str, str]] = (),
                 decoded_by: Sequence[tuple[str, str]] = ()) -> None:
        """A served request; `local`: the router had it prefilled on its decode worker. `prompt_by`: the
        (worker, role) that computed its prompt, `decoded_by`: the one that decoded it (one per completion
        of an n > 1 request; each gets the request's TTFT and TPOT)."""
        self.finished_n += 1
        self.local_n += local
        for n in output_lens:
            self._fields["output_lens"].add(n)
        self._fields["ttft_s"].add(ttft_s)
        decoded = max(output_lens, default=0) > 1
        if decoded:
            self._fields["tpot_s"].add(tpot_s)
        for w, role in set(prompt_by):
            if (res := self._worker(w, role)) is not None:
                res[0].add(ttft_s)
        for w, role in set(decoded_by) if decoded else ():
            if (res := self._worker(w, role)) is not None:
                res[1].add(tpot_s)
        self.prompt_tokens += prompt_len
        self.cached_tokens += min(cached_tokens, prompt_len)

    def take(self) -> TrafficWindow:
        """Everything since the last take, as one window; starts the next."""
        now = time.time()
        f = self._fields
        w = TrafficWindow(self.start_s, now, self.arrivals, tuple(int(v) for v in f["prompt_lens"].items),
                          tuple(int(v) for v in f["output_lens"].items), tuple(f["ttft_s"].items),
                          tuple(f["tpot_s"].items), self.prompt_tokens, self.cached_tokens, self.finished_n,
                          self.local_n, tuple(WorkerWindow(w, role, tuple(t.items), tuple(d.items))
                                              for (w, role), (t, d) in sorted(self._workers.items())))
        self._reset(now)
        return w


async def report_loop(log: TrafficLog, controller: Any, replica: str, every_s: float, on_reply: Any) -> None:
    """Hand the controller this replica's window every `every_s`; a failed report keeps its window
    (merged into the next), so no arrival is lost while the controller restarts."""
    pending: list[TrafficWindow] = []
    while True:
        await asyncio.sleep(every_s)
        pending.append(log.take())
        try:
            reply = await asyncio.wait_for(controller.report_traffic.remote(replica, pending), timeout=REPORT_TIMEOUT_S)
            pending = []
            on_reply(reply)
        except Exception as e:  # noqa: BLE001 - keep reporting; the controller may restart
            logger.warning("traffic report to the controller failed: %s", e)
            del pending[:-60]  # NOTE: bounded: at most a few minutes of windows wait for the controller
