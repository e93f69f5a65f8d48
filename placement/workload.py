"""Workloads: request lengths, arrival processes (Poisson, gamma), trace files. The one generator of
traces, length distributions and arrivals for both the planner and the benchmarks (benchmarks/workload.py
wraps it with prompts and its own request types).

A `Workload` draws lengths and unit-rate inter-arrival gaps once; `at_rate(r)` rescales the gaps. The
same draws at every rate (common random numbers) keep attainment-versus-rate curves smooth, which
the goodput binary search relies on. Gaps are gamma draws with mean 1 and the given coefficient of
variation; at CV 1 numpy's gamma is its exponential, so Poisson is the same stream.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from placement.config import LengthDist, WorkloadSpec
from placement.errors import PlacementError

logger = logging.getLogger(__name__)

MAX_REQUESTS = 100_000


class Request(NamedTuple):
    """One request of a trace: arrival time (s from start), prompt and output lengths in tokens."""

    arrival_s: float
    input_len: int
    output_len: int


def lognormal_lengths(mu: float, sigma: float, n: int, rng: np.random.Generator, low: int = 1,
                      high: int = 1_000_000) -> np.ndarray:
    """n lengths exp(N(mu, sigma)), rounded half to even and clipped to [low, high]."""
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(np.int64)


def jittered_lengths(input_len: int, output_len: int, jitter: float, n: int,
                     rng: np.random.Generator) -> list[tuple[int, int]]:
    """n (input, output) pairs, each length uniform within +-jitter of its value (at least 1); the two
    draws of a pair are taken one after the other."""
    lo, hi = 1 - jitter, 1 + jitter
    return [(max(1, round(input_len * rng.uniform(lo, hi))), max(1, round(output_len * rng.uniform(lo, hi))))
            for _ in range(n)]


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist.kind == "fixed":
        assert dist.value is not None
        out = np.full(n, dist.value, dtype=np.int64)
    elif dist.kind == "uniform":
        assert dist.low is not None and dist.high is not None
        out = rng.integers(dist.low, dist.high + 1, size=n)
    else:
        assert dist.mean is not None and dist.sd is not None
        # Lognormal with the given mean and sd (of the lengths, not of their logs).
        sigma2 = np.log1p((dist.sd / dist.mean) ** 2)
        mu = np.log(dist.mean) - sigma2 / 2
        out = lognormal_lengths(float(mu), float(np.sqrt(sigma2)), n, rng, dist.min, dist.max)
    return np.clip(out, dist.min, dist.max)


def gamma_gaps(n: int, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n inter-arrival gaps with mean 1 s and coefficient of variation `cv` (1: exponential, Poisson)."""
    if not (cv > 0 and math.isfinite(cv)):
        raise PlacementError(f"arrival cv={cv!r} must be > 0 (1 is Poisson)")
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / shape, size=n)


def unit_gaps(n: int, process: str, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Inter-arrival gaps with mean 1 s: exponential (Poisson) or gamma with the given CV."""
    return gamma_gaps(n, 1.0 if process == "poisson" else cv, rng)


def arrival_times(rate: float, num_requests: int | None, duration_s: float | None, cv: float,
                  rng: np.random.Generator, max_requests: int = MAX_REQUESTS) -> list[float]:
    """Open-loop send times from 0: the first at 0, gamma gaps (mean 1/rate, CV `cv`) after; stops at
    `num_requests`, at `duration_s` or at `max_requests`, whichever comes first. Draws gaps in blocks,
    so the generator is left further on than the gaps used."""
    if not rate > 0:
        raise PlacementError(f"rate={rate!r} must be > 0")
    limit = min(num_requests or max_requests, max_requests)
    times: list[float] = []
    t = 0.0
    while len(times) < limit:
        # NOTE: cumsum from t adds the gaps one by one, as a running `t += gap` would (same floats).
        steps = np.cumsum(np.concatenate(([t], gamma_gaps(min(1024, limit), cv, rng) / rate)))
        for at in steps[:-1]:
            if len(times) >= limit or (duration_s is not None and at >= duration_s):
                return times
            times.append(float(at))
        t = float(steps[-1])
    return times


def clip_to_context(inputs: np.ndarray, outputs: np.ndarray, max_context: int) -> tuple[np.ndarray, np.ndarray]:
    inputs = np.minimum(inputs, max_context - 1)
    outputs = np.maximum(1, np.minimum(outputs, max_context - inputs))
    return inputs, outputs


@dataclass
class Workload:
    """Lengths and unit-rate arrival times; `at_rate` gives the requests for one arrival rate."""

    inputs: np.ndarray
    outputs: np.ndarray
    unit_arrivals: np.ndarray | None
    trace_arrivals: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def mean_input(self) -> float:
        return float(self.inputs.mean())

    @property
    def mean_output(self) -> float:
        return float(self.outputs.mean())

    def remote_share(self, local_tokens: int) -> float:
        """The share of requests a prefill pool serves when prompts of at most `local_tokens` tokens are
        prefilled on their decode worker (0: all of them)."""
        return float((self.inputs > local_tokens).mean()) if local_tokens and len(self.inputs) else 1.0

    def at_rate(self, rate_rps: float | None) -> list[Request]:
        if rate_rps is None:
            if self.trace_arrivals is None:
                raise PlacementError("no arrival rate given and the trace has no arrival_s column")
            arrivals = self.trace_arrivals
        else:
            if rate_rps <= 0:
                raise PlacementError(f"arrival rate {rate_rps} req/s must be > 0")
            base = self.unit_arrivals if self.unit_arrivals is not None else np.arange(len(self.inputs), dtype=float)
            arrivals = base / rate_rps
        return [Request(float(a), int(i), int(o)) for a, i, o in zip(arrivals, self.inputs, self.outputs, strict=True)]

    @classmethod
    def from_spec(cls, spec: WorkloadSpec, n: int, seed: int = 0, max_context: int | None = None) -> Workload:
        rng = np.random.default_rng(seed)
        trace_arrivals = None
        if spec.trace is not None:
            reqs = load_trace(spec.trace)
            idx = rng.choice(len(reqs), size=n, replace=len(reqs) < n) if len(reqs) != n else np.arange(n)
            inputs = np.array([reqs[i].input_len for i in idx], dtype=np.int64)
            outputs = np.array([reqs[i].output_len for i in idx], dtype=np.int64)
            if all(r.arrival_s >= 0 for r in reqs) and len(reqs) == n:
                trace_arrivals = np.array([r.arrival_s for r in reqs])
        else:
            assert spec.input is not None and spec.output is not None
            inputs = sample_lengths(spec.input, n, rng)
            outputs = sample_lengths(spec.output, n, rng)
        if max_context is not None:
            inputs, outputs = clip_to_context(inputs, outputs, max_context)
        unit = np.cumsum(unit_gaps(n, spec.arrival, spec.cv, rng))
        return cls(inputs, outputs, unit, trace_arrivals)


def remote_prompts(reqs: Sequence[Request], local_tokens: int) -> list[Request]:
    """The requests a prefill pool serves when prompts of at most `local_tokens` tokens are prefilled on their
    decode worker (0: all of them)."""
    return [r for r in reqs if r.input_len > local_tokens] if local_tokens else list(reqs)


def gamma_trace(n: int, rate_rps: float, cv: float, input_len: LengthDist, output_len: LengthDist,
                seed: int = 0, max_context: int | None = None) -> list[Request]:
    """`n` requests with gamma inter-arrivals (mean 1/rate, coefficient of variation `cv`), seeded."""
    if rate_rps <= 0 or cv <= 0:
        raise PlacementError(f"gamma_trace needs rate_rps > 0 and cv > 0, got {rate_rps} and {cv}")
    spec = WorkloadSpec(arrival="gamma", cv=cv, input=input_len, output=output_len)
    return Workload.from_spec(spec, n, seed, max_context).at_rate(rate_rps)


def load_trace(path: str | Path) -> list[Request]:
    """CSV (header row) or JSONL with input_len, output_len and optionally arrival_s (else -1). Lengths
    must be >= 1; arrival_s is on every row or none, and non-decreasing."""
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"trace file {str(p)!r} does not exist; give a .csv or .jsonl path")
    rows: list[dict[str, object]]
    if p.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    out = []
    for i, row in enumerate(rows, 1):
        try:
            inp, outp = int(str(row["input_len"])), int(str(row["output_len"]))
            arr = float(str(row["arrival_s"])) if row.get("arrival_s") not in (None, "") else -1.0
        except (KeyError, ValueError, TypeError) as exc:
            raise PlacementError(f"trace {p} row {i} ({row!r}): needs integer input_len and output_len and "
                                 f"optional number arrival_s ({exc})") from None
        if inp < 1 or outp < 1:
            raise PlacementError(f"trace {p} row {i}: lengths must be >= 1, got {inp}, {outp}")
        out.append(Request(arr, inp, outp))
    if not out:
        raise PlacementError(f"trace file {p} has no rows; columns are input_len,output_len[,arrival_s]")
    timed = {r.arrival_s >= 0 for r in out}
    if len(timed) > 1:
        raise PlacementError(f"trace {p}: arrival_s is given on some rows only; give it on all or none")
    if any(b.arrival_s < a.arrival_s for a, b in zip(out, out[1:], strict=False)):
        raise PlacementError(f"trace {p}: arrival_s must be non-decreasing; sort the rows by arrival_s")
    return out


class Period(NamedTuple):
    """One interval of a day-shaped trace: its arrival rate and the share of long-document requests."""

    start_s: float
    length_s: float
    rate_rps: float
    doc_share: float


CHAT = (LengthDist(kind="lognormal", mean=600, sd=400, max=8000), LengthDist(kind="lognormal", mean=250, sd=150, max=2000))
DOCS = (LengthDist(kind="lognormal", mean=6000, sd=2500, max=30000),
        LengthDist(kind="lognormal", mean=400, sd=200, max=2000))


def day_periods(intervals: int = 48, day_s: float = 86400.0, base_rps: float = 3.0, peak_rps: float = 24.0,
                peak_hour: float = 15.0, bursts: tuple[tuple[int, float], ...] = ((19, 1.8), (20, 1.5), (33, 2.0)),
                doc_share: tuple[float, float] = (0.05, 0.6)) -> list[Period]:
    """A day: the rate follows a cosine from `base_rps` (night) to `peak_rps` (`peak_hour`), with bursts
    ((interval, factor)); the share of long documents grows linearly over the day (chat in the morning,
    pasted documents by night)."""
    out = []
    for i in range(intervals):
        t = i * day_s / intervals
        hour = 24.0 * t / day_s
        shape = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - peak_hour + 12.0) / 24.0)
        rate = base_rps + (peak_rps - base_rps) * shape
        rate *= dict(bursts).get(i, 1.0)
        share = doc_share[0] + (doc_share[1] - doc_share[0]) * i / max(1, intervals - 1)
        out.append(Period(t, day_s / intervals, rate, share))
    return out


def period_requests(p: Period, sample_s: float, rng: np.random.Generator) -> list[Request]:
    """`sample_s` seconds of one period's traffic (Poisson arrivals at its rate, its chat/document mix),
    from time 0."""
    n = max(1, int(round(p.rate_rps * sample_s)))
    arrivals = np.cumsum(unit_gaps(n, "poisson", 1.0, rng)) / p.rate_rps
    docs = rng.random(n) < p.doc_share
    ins = np.where(docs, sample_lengths(DOCS[0], n, rng), sample_lengths(CHAT[0], n, rng))
    outs = np.where(docs, sample_lengths(DOCS[1], n, rng), sample_lengths(CHAT[1], n, rng))
    return [Request(float(a), int(i), int(o)) for a, i, o in zip(arrivals, ins, outs, strict=True)]
