"""Re-planning from observed traffic: forecast the next interval, size both pools for it, act with
hysteresis and a cooldown.

Pure (no engine, no Ray): the PoolController's planner loop (cluster/control/autoplan.py) and the
simulated study (placement/replan_study.py) drive the same `Replanner`.

Each interval the caller hands a `TrafficWindow` (arrivals, prompt and output lengths, prefix-hit rate,
measured TTFT and TPOT of the requests that finished). The Replanner
- corrects its latency model online: prefill times and decode steps are multiplied by factors that move
  each window by the ratio of measured to predicted p50 TTFT (TPOT), the prediction made by the corrected
  model itself at the pool sizes that served the window (damped), so the factors settle where the model
  reproduces the measurements, queueing included;
- compares each worker with its pool (placement.peers: every decision lists the ratios, a shrink drains a
  worker much slower than its pool first), and learns the pool's TTFT correction from the prefill pool's
  own prompts where the window says which worker served what (a local prefill's TTFT is its own matter);
- forecasts the next interval's arrival rate (Holt: level + trend, so a ramp is met, not chased) and uses
  the last windows' lengths as the length distribution; it plans for the larger of the forecast and the
  rate just seen, plus `headroom`;
- sizes each pool: the fewest instances whose simulated attainment at the forecast rate meets the SLO's
  attainment target (prefill against TTFT, decode against TPOT, then both together), within min/max;
- acts: up at once (after `up_cooldown_s`), down only when `down_after` windows in a row wanted fewer and
  `cooldown_s` has passed since the last change, and then only to the largest of those windows' wants,
  each sized with `shrink_headroom` (more margin than a grow: near its edge a pool's attainment falls
  off a cliff).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from placement.config import SLOSpec
from placement.latency import LatencyModel
from placement.peers import PeerComparison, WorkerRatio, WorkerWindow, drain_order
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.workload import Request, Workload, remote_prompts, unit_gaps

SAMPLE = 400  # lengths kept per merged window
MIN_REQUESTS, MAX_REQUESTS = 200, 3000  # simulated per sizing probe (lengths resampled from recent windows)
MAX_HIT_RATE = 0.95  # prefix-cache hits the model counts at most (a prompt's last token is always computed)
LIFETIMES = 4  # a probe spans at least this many request lifetimes, so decode reaches its steady state
MAX_PROBES = 24  # per pool per step: sizing is bounded whatever the traffic


class TrafficWindow(NamedTuple):
    """What one interval saw at the ingress: every arrival (refused ones too: demand, not service)."""

    start_s: float
    end_s: float
    arrivals: int
    prompt_lens: tuple[int, ...]  # of the arrivals (a sample when there are many)
    output_lens: tuple[int, ...]  # of the requests that finished
    ttft_s: tuple[float, ...] = ()  # measured, of the requests that finished
    tpot_s: tuple[float, ...] = ()
    prompt_tokens: int = 0  # of the finished requests, all of them (the tuples above may be samples)
    cached_tokens: int = 0  # of those, prefix-cache hits the engines reported
    finished: int = 0  # requests that finished (all of them)
    local_prefills: int = 0  # of those, prefilled on their decode worker (the router's local placement)
    workers: tuple[WorkerWindow, ...] = ()  # the finished requests' samples by the worker that served them

    @property
    def rate_rps(self) -> float:
        return self.arrivals / max(self.end_s - self.start_s, 1e-9)

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _thin(xs: list, cap: int) -> tuple:
    """At most ~`cap` of `xs`, evenly spaced."""
    return tuple(xs[:: max(1, math.ceil(len(xs) / cap))])


def merge_windows(windows: Sequence[TrafficWindow], start_s: float, end_s: float,
                  cap: int = 4 * SAMPLE) -> TrafficWindow:
    """Several ingress replicas' windows as one interval [start_s, end_s) (samples capped at `cap`, a
    worker's at SAMPLE)."""
    def joined(field_: str) -> tuple:
        return _thin([v for w in windows for v in getattr(w, field_)], cap)

    by: dict[tuple[str, str], list[WorkerWindow]] = {}
    for w in windows:
        for ww in w.workers:
            by.setdefault((ww.worker, ww.role), []).append(ww)
    workers = tuple(WorkerWindow(k[0], k[1], _thin([v for ww in ws for v in ww.ttft_s], SAMPLE),
                                 _thin([v for ww in ws for v in ww.tpot_s], SAMPLE)) for k, ws in sorted(by.items()))
    return TrafficWindow(start_s, end_s, sum(w.arrivals for w in windows), joined("prompt_lens"),
                         joined("output_lens"), joined("ttft_s"), joined("tpot_s"),
                         sum(w.prompt_tokens for w in windows), sum(w.cached_tokens for w in windows),
                         sum(w.finished for w in windows), sum(w.local_prefills for w in windows), workers)


class Sizes(NamedTuple):
    prefill: int
    decode: int  # the colocated pool's size in colocated mode (prefill is then 0)


class Decision(NamedTuple):
    at_s: float
    observed_rps: float
    forecast_rps: float
    wanted: Sizes  # what the forecast needs
    target: Sizes  # what the loop sets (or, advisory, would set) after hysteresis, cooldown, min/max
    current: Sizes
    predicted_attainment: float  # of `target` at the planned rate (max of forecast and observed), corrected model
    predicted_goodput_rps: float
    ttft_correction: float
    tpot_correction: float
    forecast_error: float | None  # |forecast made for this window - observed| / observed
    reason: str
    prefix_hit_rate: float = 0.0  # of the recent windows' prompt tokens, as the model counts it
    local_prefill_tokens: int = 0  # prompts up to this long simulated as prefilled on their decode worker
    workers: tuple[WorkerRatio, ...] = ()  # each worker against its pool (placement.peers)

    def as_dict(self) -> dict[str, object]:
        d = self._asdict()
        for k in ("wanted", "target", "current"):
            d[k] = d[k]._asdict()
        d["workers"] = [w._asdict() for w in self.workers]
        return d

    def drain_order(self, role: str) -> list[str]:
        """Workers of `role` a shrink should drain first (placement.peers.drain_order)."""
        return drain_order(self.workers, role)


@dataclass(frozen=True)
class LoopSettings:
    min: Sizes = Sizes(1, 1)
    max: Sizes = Sizes(8, 8)
    down_after: int = 3  # windows in a row that must want fewer before a pool shrinks
    cooldown_s: float = 60.0  # since the last change, before a pool shrinks
    up_cooldown_s: float = 0.0  # since the last change, before a pool grows
    alpha: float = 0.5  # Holt level smoothing
    beta: float = 0.3  # Holt trend smoothing
    correction_alpha: float = 0.3  # weight of a new measured/predicted ratio (in log space)
    headroom: float = 0.1  # grow for this much more than the forecast (forecasts miss; a pool at its edge fails)
    shrink_headroom: float = 0.3  # shrink only to what still holds at this much more
    correction_bounds: tuple[float, float] = (0.25, 4.0)
    history: int = 4  # windows whose lengths form the planning sample
    max_prefill_tokens: int = 4096
    chunked_prefill: bool = False  # colocated engines: prompt chunks share steps with the decodes (vLLM v1)
    colocated: bool = False
    first_token_from_prefill: bool = True  # our P/D streams the prefill's token: the KV transfer is in TPOT
    max_probe_requests: int = MAX_REQUESTS  # the live loop sizes in the controller: it keeps probes smaller


class Forecaster:
    """Holt's linear trend, damped (phi), on the per-window arrival rate; `error` is the last forecast's
    relative error."""

    def __init__(self, alpha: float, beta: float, phi: float = 0.9) -> None:
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self.level: float | None = None
        self.trend = 0.0
        self.next: float | None = None
        self.error: float | None = None

    def update(self, observed: float) -> float:
        if self.next is not None:
            self.error = abs(self.next - observed) / observed if observed > 0 else None
        if self.level is None:
            self.level = observed
        else:
            prev = self.level
            self.level = self.alpha * observed + (1 - self.alpha) * (self.level + self.phi * self.trend)
            self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.phi * self.trend
        self.next = max(0.0, self.level + self.phi * self.trend)
        return self.next


@dataclass
class Replanner:
    prefill_lat: LatencyModel  # the colocated engine's model in colocated mode
    decode_lat: LatencyModel
    slo: SLOSpec
    settings: LoopSettings = field(default_factory=LoopSettings)
    seed: int = 0

    def __post_init__(self) -> None:
        s = self.settings
        self.forecaster = Forecaster(s.alpha, s.beta)
        self.ttft_corr = 1.0
        self.tpot_corr = 1.0
        self._corrected: tuple[tuple[float, ...], LatencyModel, LatencyModel] | None = None
        self._local = 0
        self._windows: deque[TrafficWindow] = deque(maxlen=max(1, s.history))
        self._recent: deque[Sizes] = deque(maxlen=max(1, s.down_after))
        self._changed_at = -math.inf
        self.decisions: list[Decision] = []
        self.peers = PeerComparison(s.correction_alpha)

    def set_decode_model(self, lat: LatencyModel) -> None:
        """A new decode model (colocated: the one engine's): e.g. a speculating pool's at a newly measured
        acceptance rate. The TPOT correction learnt against the old one starts again."""
        self.decode_lat = lat
        if self.settings.colocated:
            self.prefill_lat = lat
        self.tpot_corr, self._corrected = 1.0, None

    # ---- one interval ------------------------------------------------------------------------------
    def step(self, window: TrafficWindow, current: Sizes) -> Decision:
        self._windows.append(window)
        self.peers.update(window.workers)
        self._local = self._local_threshold()  # NOTE: once per window; every sizing probe reads it
        wl = self._workload()
        if wl is not None and window.arrivals:
            self._correct(window, current, wl)
        forecast = self.forecaster.update(window.rate_rps)
        # NOTE: plan for the forecast on the way up, never below what this window saw on the way down: a
        # falling trend may shrink the pools only through the hysteresis, which also needs later windows.
        rate = max(forecast, window.rate_rps) * (1 + self.settings.headroom)
        s = self.settings
        if wl is None or not rate > 0:
            wanted = keep = s.min
            reason = "no traffic: the minimum"
        else:
            wanted = self.size(wl, rate)
            keep = wanted
            if any(w < c for w, c in zip(wanted, current, strict=True)):
                # NOTE: asymmetric: near a pool's edge attainment falls off a cliff, so a shrink must still
                # hold with more margin than a grow asks for
                slack = (1 + s.shrink_headroom) / (1 + s.headroom)
                keep = Sizes(*(max(a, b) for a, b in zip(wanted, self.size(wl, rate * slack), strict=True)))
            reason = f"sized for {rate:.3g} req/s (forecast {forecast:.3g})"
        target, why = self._act(window.end_s, wanted, keep, current)
        att = self.attainment(wl, rate, target) if wl is not None and rate > 0 else 1.0
        d = Decision(window.end_s, round(window.rate_rps, 4), round(forecast, 4), wanted, target, current,
                     round(att, 4), round(att * rate, 4), round(self.ttft_corr, 4), round(self.tpot_corr, 4),
                     None if self.forecaster.error is None else round(self.forecaster.error, 4),
                     f"{reason}; {why}", round(self.prefix_hit_rate(), 4), self.local_prefill_tokens(),
                     self.peers.ratios())
        self.decisions.append(d)
        del self.decisions[:-500]
        return d

    def _act(self, now: float, wanted: Sizes, keep: Sizes, current: Sizes) -> tuple[Sizes, str]:
        """`wanted`: what the forecast needs (a grow goes there); `keep`: the fewest a shrink may leave."""
        s = self.settings

        def bounded(x: Sizes) -> Sizes:
            x = Sizes(*(min(hi, max(lo, w)) for w, lo, hi in zip(x, s.min, s.max, strict=True)))
            return x._replace(prefill=0) if s.colocated else x

        wanted, keep = bounded(wanted), bounded(keep)
        self._recent.append(keep)
        since = now - self._changed_at
        # NOTE: a pool that should shrink does not shrink while the other grows (one move at a time)
        grow = Sizes(*(max(w, c) for w, c in zip(wanted, current, strict=True)))
        if grow != current:
            if since < s.up_cooldown_s:
                return current, f"grow held: {since:.0f}s since the last change < up_cooldown_s"
            self._changed_at = now
            return grow, "grow"
        if keep == current:
            return current, "hold"
        if len(self._recent) < s.down_after:
            return current, f"shrink held: fewer wanted in fewer than down_after={s.down_after} windows"
        # each pool shrinks only to the most any of the last down_after windows wanted
        shrink = Sizes(*(min(c, max(vals)) for c, vals in zip(current, zip(*self._recent, strict=True),
                                                               strict=True)))
        if shrink == current:
            return current, f"shrink held: fewer not wanted in all of the last {s.down_after} windows"
        if since < s.cooldown_s:
            return current, f"shrink held: {since:.0f}s since the last change < cooldown_s"
        self._changed_at = now
        return shrink, "shrink"

    # ---- the model ---------------------------------------------------------------------------------
    def _workload(self, rate: float | None = None) -> Workload | None:
        """Lengths resampled from the recent windows; Poisson arrivals. Enough requests at `rate` to span
        LIFETIMES request lifetimes (and at least 30 s), within [MIN_REQUESTS, MAX_REQUESTS]."""
        prompts = [n for w in self._windows for n in w.prompt_lens]
        outputs = [n for w in self._windows for n in w.output_lens]
        if not prompts:
            return None
        rng = np.random.default_rng(self.seed)
        # NOTE: outputs are known only for finished requests; with none yet, half the median prompt
        outs = np.asarray(outputs or [max(1, int(np.median(prompts)) // 2)])
        ins = np.asarray(prompts)
        life_s = self.slo.ttft_s + float(outs.mean()) * self.slo.tpot_s
        k = MIN_REQUESTS if rate is None else int(rate * max(30.0, LIFETIMES * life_s))
        k = min(self.settings.max_probe_requests, max(MIN_REQUESTS, k))
        return Workload(rng.choice(ins, k), rng.choice(outs, k), np.cumsum(unit_gaps(k, "poisson", 1.0, rng)))

    def _targets(self) -> tuple[float, float]:
        return self.slo.ttft_s, self.slo.tpot_s

    def prefix_hit_rate(self) -> float:
        """The share of prompt tokens the engines served from their prefix caches over the recent windows
        (0 until they report any), at most MAX_HIT_RATE."""
        prompt = sum(w.prompt_tokens for w in self._windows)
        return min(MAX_HIT_RATE, sum(w.cached_tokens for w in self._windows) / prompt) if prompt else 0.0

    def local_prefill_tokens(self) -> int:
        """The prompt length up to which requests count as prefilled on their decode worker (see
        `_local_threshold`; set as each window arrives)."""
        return self._local

    def _local_threshold(self) -> int:
        """The prompt length up to which requests count as prefilled on their decode worker: the router
        decides per request from predicted costs, mostly for short prompts, so the recent windows' share of
        local prefills is taken as the shortest prompts' share (that quantile of their prompt lengths)."""
        if self.settings.colocated:
            return 0
        done = sum(w.finished for w in self._windows)
        share = sum(w.local_prefills for w in self._windows) / done if done else 0.0
        prompts = sorted(n for w in self._windows for n in w.prompt_lens)
        if share <= 0.0 or not prompts:
            return 0
        return prompts[min(len(prompts) - 1, max(0, math.ceil(share * len(prompts)) - 1))]

    def models(self) -> tuple[LatencyModel, LatencyModel]:
        """The latency models corrected by what the serving machine measured, with prefill work cut by the
        prefix-cache hit rate the engines report: a cached prefix is not computed again
        (`LatencyModel.with_prefix_hits`); the TTFT correction, learnt against this model, takes up the rest. Modelled, not folded into the correction, so a shift in the
        hit rate (multi-turn chat giving way to fresh documents) moves the plan at once."""
        hit = round(self.prefix_hit_rate(), 3)
        k = (self.ttft_corr, self.tpot_corr, hit)
        if self._corrected is None or self._corrected[0] != k:
            pk, dk = self.ttft_corr, self.tpot_corr
            self._corrected = (k, self.prefill_lat.scaled(pk, dk).with_prefix_hits(hit),
                               self.decode_lat.scaled(pk, dk).with_prefix_hits(hit))
        return self._corrected[1], self._corrected[2]

    def _sim(self, reqs: Sequence[Request], sizes: Sizes, mode: str = "both"):
        s = self.settings
        p_lat, d_lat = self.models()
        if s.colocated:
            return simulate_colocated(d_lat, max(1, sizes.decode), reqs, max_prefill_tokens=s.max_prefill_tokens,
                                      chunked_prefill=s.chunked_prefill)
        local = self.local_prefill_tokens()
        if local and mode == "prefill":  # NOTE: the prefill pool sees only the prompts it prefills
            reqs = remote_prompts(reqs, local) or list(reqs[:1])
        return simulate_disaggregated(p_lat, d_lat, max(1, sizes.prefill), max(1, sizes.decode),
                                      reqs, mode=mode, max_prefill_tokens=s.max_prefill_tokens,
                                      local_prefill_tokens=local if mode != "prefill" else 0,
                                      first_token_from_prefill=s.first_token_from_prefill)

    def attainment(self, wl: Workload, rate: float, sizes: Sizes) -> float:
        ttft, tpot = self._targets()
        return self._sim((self._workload(rate) or wl).at_rate(rate), sizes).attainment(ttft, tpot)

    def size(self, wl: Workload, rate: float) -> Sizes:
        """The fewest instances per pool meeting the attainment target at `rate` (capped at max)."""
        s, target = self.settings, self.slo.attainment
        ttft, tpot = self._targets()
        wl = self._workload(rate) or wl
        reqs = wl.at_rate(rate)
        if s.colocated:
            n = self._fewest(lambda k: self._sim(reqs, Sizes(0, k)).attainment(ttft, tpot) >= target,
                             s.min.decode, s.max.decode)
            return Sizes(0, n)
        n_p = self._fewest(lambda k: self._sim(reqs, Sizes(k, 1), "prefill").attainment(ttft, math.inf) >= target,
                           s.min.prefill, s.max.prefill)
        n_d = self._fewest(lambda k: self._sim(reqs, Sizes(1, k), "decode").attainment(math.inf, tpot) >= target,
                           s.min.decode, s.max.decode)
        # NOTE: each phase alone meeting the target does not make both together meet it: add to the pool
        # whose phase misses more, bounded.
        for _ in range(MAX_PROBES):
            res = self._sim(reqs, Sizes(n_p, n_d))
            if res.attainment(ttft, tpot) >= target or (n_p >= s.max.prefill and n_d >= s.max.decode):
                break
            miss_p = 1 - res.attainment(ttft, math.inf)
            miss_d = 1 - res.attainment(math.inf, tpot)
            if (miss_p >= miss_d and n_p < s.max.prefill) or n_d >= s.max.decode:
                n_p += 1
            else:
                n_d += 1
        return Sizes(n_p, n_d)

    @staticmethod
    def _fewest(ok, lo: int, hi: int) -> int:
        """Smallest k in [lo, hi] with ok(k) (hi if none); ok is monotone in k. Doubling, then bisection."""
        lo, hi = max(1, lo), max(1, hi, lo)
        if ok(lo):
            return lo
        bad, step = lo, 1
        while True:  # NOTE: bounded: the step doubles until it reaches hi
            k = min(hi, bad + step)
            if ok(k):
                good = k
                break
            if k == hi:
                return hi
            bad, step = k, step * 2
        while good - bad > 1:
            mid = (good + bad) // 2
            if ok(mid):
                good = mid
            else:
                bad = mid
        return good

    def _correct(self, window: TrafficWindow, current: Sizes, wl: Workload) -> None:
        """Measured p50 TTFT and TPOT of this window against what the corrected model predicts at the sizes
        that served it; each correction moves by that ratio (damped, in log space), so it converges on
        the factor that makes the model reproduce the measurements, queueing included."""
        if not window.ttft_s:
            return
        rate = max(window.rate_rps, 1e-6)
        pred = self._sim((self._workload(rate) or wl).at_rate(rate), current)
        done = [r for r in pred.records if not r.rejected]
        # NOTE: in an overloaded window both sides are queueing, and how much depends on how long the window
        # and the sample run: the ratio says little about the engines then
        if not done or pred.attainment(*self._targets()) < 0.5:
            return
        lo, hi = self.settings.correction_bounds
        a = self.settings.correction_alpha

        def moved(corr: float, measured: float, predicted: float) -> float:
            if not (measured > 0 and predicted > 0):
                return corr
            return min(hi, max(lo, corr * (measured / predicted) ** a))

        measured, predicted = window.ttft_s, [r.ttft_s for r in done]
        remote = [v for ww in window.workers if ww.role == "prefill" for v in ww.ttft_s]
        sim_remote = [r.ttft_s for r in done if r.prefill >= 0]
        if remote and sim_remote and not self.settings.colocated:
            # NOTE: the prefill pool's prompts against their simulated peers: a local prefill's TTFT (no
            # transfer, a decode batch sharing the step) says little about the prefill pool's speed
            measured, predicted = tuple(remote), sim_remote
        self.ttft_corr = moved(self.ttft_corr, float(np.median(measured)), float(np.median(predicted)))
        tpots = [r.tpot_s for r in done if r.output_len > 1]
        if tpots and window.tpot_s:
            self.tpot_corr = moved(self.tpot_corr, float(np.median(window.tpot_s)), float(np.median(tpots)))
