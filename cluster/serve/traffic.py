"""What this ingress replica saw, for the planner loop: arrivals with their prompt lengths, finished
requests with output lengths, TTFT, TPOT and prefix-cache hits. Reported to the PoolController every few
seconds as a typed TrafficWindow (placement.replan); the reply is the loop's latest decision, which this
replica exposes in /v1/stats and as saaf_planner_* metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from placement.replan import TrafficWindow

logger = logging.getLogger(__name__)

SAMPLE_CAP = 2000  # per field per report: a reservoir sample beyond this
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

    def arrival(self, prompt_len: int, n: int = 1) -> None:
        """A request reached the engine client (admitted or not: demand). `n` completions = n arrivals."""
        self.arrivals += n
        for _ in range(n):
            self._fields["prompt_lens"].add(prompt_len)

    def finished(self, prompt_len: int, output_lens: list[int], ttft_s: float, tpot_s: float,
                 cached_tokens: int, local: bool = False) -> None:
        """A served request; `local`: the router had it prefilled on its decode worker."""
        self.finished_n += 1
        self.local_n += local
        for n in output_lens:
            self._fields["output_lens"].add(n)
        self._fields["ttft_s"].add(ttft_s)
        if max(output_lens, default=0) > 1:
            self._fields["tpot_s"].add(tpot_s)
        self.prompt_tokens += prompt_len
        self.cached_tokens += min(cached_tokens, prompt_len)

    def take(self) -> TrafficWindow:
        """Everything since the last take, as one window; starts the next."""
        now = time.time()
        f = self._fields
        w = TrafficWindow(self.start_s, now, self.arrivals, tuple(int(v) for v in f["prompt_lens"].items),
                          tuple(int(v) for v in f["output_lens"].items), tuple(f["ttft_s"].items),
                          tuple(f["tpot_s"].items), self.prompt_tokens, self.cached_tokens, self.finished_n,
                          self.local_n)
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
