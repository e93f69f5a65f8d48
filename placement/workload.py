"""Workloads: request lengths, arrival processes (Poisson, gamma), trace files.

A `Workload` draws lengths and unit-rate inter-arrival gaps once; `at_rate(r)` rescales the gaps. The
same draws at every rate (common random numbers) keep attainment-versus-rate curves smooth, which
the goodput binary search relies on.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from placement.config import LengthDist, WorkloadSpec
from placement.errors import PlacementError

logger = logging.getLogger(__name__)


class Request(NamedTuple):
    """One request of a trace: arrival time (s from start), prompt and output lengths in tokens."""

    arrival_s: float
    input_len: int
    output_len: int


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
        out = np.rint(rng.lognormal(mu, np.sqrt(sigma2), size=n)).astype(np.int64)
    return np.clip(out, dist.min, dist.max)


def unit_gaps(n: int, process: str, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Inter-arrival gaps with mean 1 s: exponential (Poisson) or gamma with the given CV."""
    if process == "poisson" or cv == 1.0:
        return rng.exponential(1.0, size=n)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / shape, size=n)


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


def gamma_trace(n: int, rate_rps: float, cv: float, input_len: LengthDist, output_len: LengthDist,
                seed: int = 0, max_context: int | None = None) -> list[Request]:
    """`n` requests with gamma inter-arrivals (mean 1/rate, coefficient of variation `cv`), seeded."""
    if rate_rps <= 0 or cv <= 0:
        raise PlacementError(f"gamma_trace needs rate_rps > 0 and cv > 0, got {rate_rps} and {cv}")
    spec = WorkloadSpec(arrival="gamma", cv=cv, input=input_len, output=output_len)
    return Workload.from_spec(spec, n, seed, max_context).at_rate(rate_rps)


def load_trace(path: str | Path) -> list[Request]:
    """CSV (header row) or JSONL with input_len, output_len and optionally arrival_s (else -1)."""
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"trace file {str(p)!r} does not exist")
    rows: list[dict[str, object]]
    if p.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    out = []
    for i, row in enumerate(rows):
        try:
            inp, outp = int(str(row["input_len"])), int(str(row["output_len"]))
            arr = float(str(row["arrival_s"])) if row.get("arrival_s") not in (None, "") else -1.0
        except (KeyError, ValueError) as exc:
            raise PlacementError(f"{p} row {i + 1}: needs integer input_len and output_len ({exc})") from None
        if inp < 1 or outp < 1:
            raise PlacementError(f"{p} row {i + 1}: lengths must be >= 1, got {inp}, {outp}")
        out.append(Request(arr, inp, outp))
    if not out:
        raise PlacementError(f"trace file {p} has no rows")
    return out
