"""The traffic every variant of a comparison sees: one workload, bounds and seed, so that each rate
step sends the same requests (lengths, prompts, rate-scaled arrival times) to every deployment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from benchmarks.workload import RequestSpec, Workload, build_requests


def parse_rates(values: Sequence[str]) -> list[float]:
    """``["0.25,0.5", "1"]`` -> ``[0.25, 0.5, 1.0]``; every rate must be a number > 0."""
    out: list[float] = []
    for item in (v.strip() for value in values for v in value.split(",")):
        if not item:
            continue
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--rates {item!r} is not a number; give requests/s, e.g. --rates 0.25,0.5,1") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"--rates {item!r} must be a finite number > 0 requests/s")
        out.append(rate)
    if not out:
        raise ValueError("--rates is empty; give at least one rate in requests/s, e.g. --rates 0.25,0.5,1")
    return out


@dataclass(frozen=True)
class Traffic:
    """``build_requests``'s inputs but the rate. ``requests(rate)`` is exactly what ``run_benchmark``
    sends with ``bench_kwargs()``: the planner predicts on the same requests the runner replays. A
    ``TraceWorkload`` with ``arrival_s`` and ``rate=None`` replays its own arrival times."""

    workload: Workload
    num_requests: int | None
    duration_s: float | None
    seed: int = 0
    burstiness_cv: float = 1.0
    max_total_len: int | None = None

    def requests(self, rate: float | None) -> list[RequestSpec]:
        return build_requests(self.workload, rate, self.num_requests, self.duration_s,
                              burstiness_cv=self.burstiness_cv, seed=self.seed, max_total_len=self.max_total_len)

    def bench_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``benchmarks.serve.run_benchmark`` that fix the requests."""
        return {"num_requests": self.num_requests, "duration_s": self.duration_s, "seed": self.seed,
                "burstiness_cv": self.burstiness_cv, "max_total_len": self.max_total_len}


class Step(NamedTuple):
    """One measured replay of a variant: ``traffic`` at ``rate`` (None: the trace's own times).
    ``key`` names the step in results: the rate itself, or e.g. ``"1/seed1"`` when rates repeat."""

    key: float | str
    rate: float | None
    traffic: Traffic


def rate_steps(traffic: Traffic, rates: Sequence[float]) -> list[Step]:
    """One step per rate, keyed by the rate."""
    return [Step(rate, rate, traffic) for rate in rates]


def request_stats(specs: Sequence[RequestSpec]) -> dict[str, float]:
    """How many requests a step sends, their mean lengths and when the last one arrives."""
    return {"requests": len(specs), "mean_input": sum(s.input_len for s in specs) / len(specs),
            "mean_output": sum(s.output_len for s in specs) / len(specs),
            "arrivals_s": round(specs[-1].arrival_s, 2)}
