"""Per-worker state of the goodput policy: EWMA corrections, routes not yet visible in the worker's
stats (the ledger), and cached request-independent parts of the predictions."""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from collections import deque

from engine.contract import WorkerStats
from placement.latency import LatencyModel, Terms

logger = logging.getLogger(__name__)
_INF = math.inf
IDLE_HALF_LIFE_S = 10.0
# NOTE: a TTFT correction too high would refuse every request, and a refused request teaches nothing: while a
# worker's prefill queue is empty it fades toward 1 (the model calibrated on this machine), more slowly.
PREFILL_IDLE_HALF_LIFE_S = 60.0
# NOTE: a colocated worker gives its streams the time its prefills leave: TPOT = step / (1 - share), the share
# taken over our routes of the last window. (A decode worker's local prefills show in the step times its step
# correction learns from; counting them here too slowed its predictions twice.)
PREFILL_LOAD_WINDOW_S = 10.0
MAX_PREFILL_SHARE = 0.8


def _idle_fade(since: float, ts: float, busy: bool, half_life_s: float) -> tuple[float, float]:
    """(stats time since which the worker has been idle, 0 if busy; the power to raise its corrections to,
    which fades them toward 1 with `half_life_s` over the idle time since `since`)."""
    if busy:
        return 0.0, 1.0
    if since and ts > since:
        return ts, 0.5 ** ((ts - since) / half_life_s)
    return ts, 1.0


def _ewma(ratio: float, observed_over_predicted: float, alpha: float) -> float:
    """Move `ratio` toward ratio x observed/predicted in log space (one sample moves it at most 3^alpha)."""
    return min(10.0, max(0.1, ratio * min(3.0, max(1 / 3, observed_over_predicted)) ** alpha))


def _learn(ratio: float, used: float | None, observed_over_predicted: float, alpha: float) -> float:
    """Move correction `ratio` (log-space EWMA) toward what one measurement says it should have been: the
    correction its prediction `used` x observed/predicted (one sample: at most 3x either way).

    NOTE: not ratio x observed/predicted: ten requests routed together with a correction of 1 and measured 2x
    slow each said "2"; multiplying the current ratio by 2^alpha ten times taught 2^(10 alpha) (8x at alpha
    0.3), and the next burst was refused whole (tests/integration/test_admission.py)."""
    target = (ratio if used is None else used) * min(3.0, max(1 / 3, observed_over_predicted))
    return min(10.0, max(0.1, ratio ** (1.0 - alpha) * target ** alpha))


class WorkerState:
    """One worker as the policy sees it: correction ratios, ledgers of what it routed there, and the
    request-independent parts of its predictions (valid while `pstats`/`dstats` is the stats object)."""

    __slots__ = ("ttft_ratio", "tpot_ratio", "tpot_b", "step_ratio", "pstats", "dstats", "led", "led_tokens", "q", "n",
                 "run", "step_ts", "base", "extra", "dls", "inc", "inc_kv", "inc_ctx", "b0", "c0", "sm", "sk",
                 "sf", "free", "kvf", "cap", "dr", "idle_ts", "pidle_ts", "dt", "dma", "dca", "pload", "pload_s",
                 "dload", "dload_n")

    def __init__(self) -> None:
        self.ttft_ratio = self.tpot_ratio = self.step_ratio = 1.0
        self.tpot_b = 1.0  # the batch the TPOT correction was learnt at (EWMA)
        self.pstats: WorkerStats | None = None
        self.dstats: WorkerStats | None = None
        self.led: deque[tuple[float, int, float]] = deque()  # (routed at, prompt, prefill deadline)
        self.led_tokens = self.q = self.n = self.run = 0
        self.step_ts = -1.0
        self.base = self.extra = 0.0
        self.dls: list[float] = []  # prefill deadlines of our queued requests (a newcomer delays them)
        self.inc: list[tuple[float, int, int]] = []  # heap of (expected arrival, KV tokens, context)
        self.inc_kv = self.inc_ctx = self.b0 = self.c0 = 0
        self.free = self.kvf = self.cap = self.dr = self.sm = self.sk = self.sf = 0.0
        self.idle_ts = 0.0  # stats time since which the worker has been idle (0: busy)
        self.pidle_ts = 0.0  # the same for its prefill queue
        self.dt: Terms | None = None  # its decode terms (speculating engines have their own)
        self.dma = self.dca = 0.0  # their per-context-token memory and compute terms
        self.pload: deque[tuple[float, float]] = deque()  # (routed at, prefill s) of prompts it runs beside streams
        self.pload_s = 0.0
        self.dload: deque[tuple[float, int]] = deque()  # (routed at, output tokens) of requests decoding here
        self.dload_n = 0

    def refresh_prefill(self, s: WorkerStats, t: Terms, cut: float) -> None:
        """Queue as prediction terms: base = pa*q + pb*sum(l^2) (lengths assumed equal), extra = p_lin*q
        + one batch's fixed cost - half the running batch; `dls`: deadlines a newcomer would delay."""
        self.pstats = s
        led, ts = self.led, s.timestamp_s
        un_t = un_n = 0
        for e in reversed(led):  # routed after the snapshot
            if e[0] <= ts:
                break
            un_t, un_n = un_t + e[1], un_n + 1
        # NOTE: prefill is FIFO, so the pending tokens are our newest routes (plus other ingresses').
        pending = s.queued_prompt_tokens + un_t
        while led and (self.led_tokens - led[0][1] >= pending or led[0][0] < cut):
            self.led_tokens -= led.popleft()[1]
        run = s.running if s.role == "prefill" else 0  # NOTE: a colocated worker's batch is decoding
        # NOTE: on a decode worker, requests pulling their KV wait too, but nothing is prefilled for them here
        waiting = max(0, s.waiting - s.pulling)
        self.pidle_ts, f = _idle_fade(self.pidle_ts, ts, bool(pending or run or waiting or un_n),
                                      PREFILL_IDLE_HALF_LIFE_S)
        self.ttft_ratio **= f
        self.dls = sorted(e[2] for e in itertools.islice(led, run, None))
        self.set_queue(t, pending, waiting + run + un_n, run)

    def set_queue(self, t: Terms, q: int, n: int, run: int) -> None:
        self.q, self.n, self.run = q, n, run
        self.base = t.pa * q + t.pb * (q * q / n if n else q * q)
        self.extra = t.p_lin * q + t.p_fixed  # NOTE: the fixed cost of one batch; more batches in the scan
        if run and n:  # NOTE: the running batch is half done on average when we arrive
            qi = q * run / n
            self.extra -= 0.5 * (t.pa * qi + t.pb * qi * qi / run + t.p_fixed + t.p_lin * qi)

    def add_prefill(self, t: Terms, now: float, prompt: int, deadline: float) -> None:
        self.led.append((now, prompt, deadline))
        self.led_tokens += prompt
        bisect.insort(self.dls, deadline)
        self.set_queue(t, self.q + prompt, self.n + 1, self.run)

    def add_prefill_load(self, now: float, seconds: float) -> None:
        """A prompt this worker prefills beside its decoding streams (``seconds``: the model's prefill time)."""
        self.pload.append((now, seconds))
        self.pload_s += seconds

    def prefill_share(self, now: float) -> float:
        """The share of the worker's time its prefills took over the last PREFILL_LOAD_WINDOW_S (at most
        MAX_PREFILL_SHARE): what its streams' decode steps do not get while the load lasts."""
        h, cut = self.pload, now - PREFILL_LOAD_WINDOW_S
        while h and h[0][0] < cut:
            self.pload_s -= h.popleft()[1]
        if not h:
            self.pload_s = 0.0  # NOTE: no float residue from the additions and subtractions
            return 0.0
        return min(MAX_PREFILL_SHARE, self.pload_s / PREFILL_LOAD_WINDOW_S)

    def add_decode_load(self, now: float, tokens: int) -> None:
        """A request routed here to decode ``tokens`` output tokens."""
        self.dload.append((now, tokens))
        self.dload_n += tokens

    def steady_batch(self, now: float, step_s: float) -> float:
        """The batch the worker settles at under the decode work routed here over the last
        PREFILL_LOAD_WINDOW_S: tokens arrive at tau per second and each step serves one per stream, so
        B = tau x step (Little's law). A request decodes through the batch as it turns over, not the snapshot
        it was routed into."""
        h, cut = self.dload, now - PREFILL_LOAD_WINDOW_S
        while h and h[0][0] < cut:
            self.dload_n -= h.popleft()[1]
        return self.dload_n / PREFILL_LOAD_WINDOW_S * step_s if h else 0.0

    def refresh_decode(self, s: WorkerStats, lat: LatencyModel, alpha: float, cut: float,
                       avg_out: float) -> None:
        self.dstats = s
        # NOTE: corrections learnt under a full batch mispredict a lone stream: while idle they fade toward 1
        # (the calibrated model) with a half-life of IDLE_HALF_LIFE_S.
        self.idle_ts, f = _idle_fade(self.idle_ts, s.timestamp_s, bool(s.running or s.waiting or self.inc),
                                     IDLE_HALF_LIFE_S)
        if f != 1.0:
            self.tpot_ratio, self.step_ratio = self.tpot_ratio ** f, self.step_ratio ** f
        steps = s.recent_step_times_s
        if s.role == "decode" and s.running and len(steps) >= 4 and s.timestamp_s != self.step_ts:
            self.step_ts = s.timestamp_s
            recent = sorted(steps[-8:])
            # NOTE: an engine step (what the stats time) yields tokens_per_step tokens per sequence
            model = lat.decode_step_time_s(s.running, s.running_context_tokens) * lat.tokens_per_step
            if model > 0:
                ratio = recent[len(recent) // 2] / model
                self.step_ratio = _ewma(self.step_ratio, ratio / self.step_ratio, alpha)
        h = self.inc
        while h and (h[0][0] <= s.timestamp_s or h[0][0] < cut):  # arrived, so in the stats now
            _, kv, ctx = heapq.heappop(h)
            self.inc_kv -= kv
            self.inc_ctx -= ctx
        queued = s.queued_prompt_tokens + s.pulling_tokens  # NOTE: both hold KV here and join the batch
        batch, ctx = s.running + s.waiting + len(h), s.running_context_tokens + queued + self.inc_ctx
        self.set_batch(lat.terms, batch, ctx)
        cap = s.kv_capacity_tokens
        self.cap = cap or _INF  # NOTE: 0 = unknown capacity, never a KV wait
        self.free = cap * (1.0 - s.kv_usage) - queued - self.inc_kv - s.waiting * avg_out if cap else _INF
        self.kvf = avg_out / max(cap - self.free, 1.0) if cap else 0.0  # wait steps per missing KV token

    def step_s(self, now: float, ctx_new: int, terms: Terms) -> float:
        """One decode step with us in the batch (`ctx_new` context tokens of ours), at least the batch the
        decode work routed here over the last PREFILL_LOAD_WINDOW_S settles at (`terms`: the pool's decode
        terms, unless the worker has its own)."""
        mem, comp = self.sm + self.dma * ctx_new, self.sk + self.dca * ctx_new
        step = ((mem if mem > comp else comp) + self.sf) * self.dr
        if self.dload:
            extra = self.steady_batch(now, step) - self.b0 - 1
            if extra > 0:
                dt = self.dt or terms
                mem += self.dma * ctx_new * extra
                comp += (dt.d_comp_b + self.dca * ctx_new) * extra
                step = ((mem if mem > comp else comp) + self.sf + dt.d_lin * extra) * self.dr
        return step

    def tpot_s(self, step: float, need: int, inv_om1: float) -> float:
        """TPOT at `step` s per token for a request needing `need` KV tokens here: KV frees as requests
        finish, each holding its KV for ~avg_out steps (`inv_om1`: 1 / (max_tokens - 1))."""
        if need <= self.free:
            return step
        if need > self.cap:
            return _INF
        return step * (1.0 + (need - self.free) * self.kvf * inv_om1)

    def tpot_correction(self, batch: int) -> float:
        """The TPOT correction for a stream joining a batch of `batch`: `tpot_ratio` where the batch is at least
        the one it was learnt at (`tpot_b`, an EWMA of the batches of the requests it learnt from), and the same
        share of it in log space as the batch is of that one below: tpot_ratio ** (batch / tpot_b).

        NOTE: what the step model leaves out grows with the batch: each stream there came with a prefill that
        interferes with the decode steps (on the prefill engine sharing the machine, or locally), and the step
        correction learns from the median step, which leaves those stalls out. Measured (the ten runs in
        benchmarks/results/goodput-paired-0.5, SmolLM2 on 2 cores): TPOT p50 0.092 s with 1 stream decoding on
        average, 0.106 with 2, 0.116 with 3, 0.134 with 4. One correction for every batch, taught by four
        streams, predicted a lone stream 1.4x too slow and refused requests that met their targets when
        admitted."""
        if batch >= self.tpot_b:
            return self.tpot_ratio
        return self.tpot_ratio ** (batch / self.tpot_b)

    def set_dr(self) -> None:
        """The decode correction for a stream joining the batch now (b0 + 1 streams)."""
        self.dr = self.tpot_correction(self.b0 + 1) * self.step_ratio

    def set_batch(self, t: Terms, b0: int, c0: int) -> None:
        """Decode step terms for a batch of b0 + 1 requests with c0 + (ours) context tokens."""
        self.b0, self.c0, self.dt, self.dma, self.dca = b0, c0, t, t.d_mem_a, t.d_comp_a
        self.set_dr()
        self.sm = t.d_mem_c + t.d_mem_a * c0
        self.sk = t.d_comp_b * (b0 + 1) + t.d_comp_a * c0
        self.sf = t.d_fixed + t.d_lin * (b0 + 1)

    def add_decode(self, t: Terms, arrival: float, need: int, ctx: int, avg_out: float) -> None:
        """A request on its way here; `t`: the decode terms, unless the worker has its own (speculation)."""
        heapq.heappush(self.inc, (arrival, need, ctx))
        self.inc_kv += need
        self.inc_ctx += ctx
        self.set_batch(self.dt or t, self.b0 + 1, self.c0 + ctx)
        self.free -= need
        if self.cap != _INF:
            self.kvf = avg_out / max(self.cap - self.free, 1.0)
