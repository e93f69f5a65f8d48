"""Fit the roofline's free parameters for one engine/hardware/precision group of measured points.

What is fitted (LatencySpec fields): `compute_efficiency` (achieved/peak tensor FLOPS), `memory_efficiency`
(achieved/peak HBM bandwidth), `layer_overhead_us` (fixed cost per layer per step: the latency floor of
a layer's small kernels), `allreduce_latency_us` (per TP all-reduce; only where the group has TP > 1)
and `ttft_overhead_ms` + `ttft_overhead_us_per_token` + `ttft_overhead_us_per_stream` (the serving front-end's
share of TTFT, fixed, per prompt token and per request in flight: tokenising and moving a long prompt takes
longer, and one front-end process streams every open request's tokens, outside the GPU). `step_overhead_ms` is held at
STEP_OVERHEAD_MS: within one model it cannot be told apart from the per-layer cost.

The loss is the mean over points of |log(pred/measured)| for TTFT plus the same for TPOT, each point
simulated with `predict` exactly as the CLI runs it (closed loop, steady state), with fewer requests.
The search is coordinate descent over multiplicative steps, deterministic, about 60 evaluations, run twice
(without and with the per-stream share) keeping the lower loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from placement.config import LatencySpec
from placement.validation import ServingPoint, predict_point

logger = logging.getLogger(__name__)

STEP_OVERHEAD_MS = 1.0
MAX_FIT_POINTS = 36
START = {"compute_efficiency": 0.5, "memory_efficiency": 0.7, "layer_overhead_us": 20.0,
         "allreduce_latency_us": 10.0, "tp_efficiency": 0.8, "ttft_overhead_ms": 40.0,
         "ttft_overhead_us_per_token": 10.0, "ttft_overhead_us_per_stream": 500.0}
BOUNDS = {"compute_efficiency": (0.05, 1.0), "memory_efficiency": (0.1, 1.0), "layer_overhead_us": (0.0, 1000.0),
          "allreduce_latency_us": (0.0, 500.0), "tp_efficiency": (0.3, 1.0), "ttft_overhead_ms": (0.0, 2000.0),
          "ttft_overhead_us_per_token": (0.0, 500.0), "ttft_overhead_us_per_stream": (0.0, 20000.0)}
TP_ONLY = ("allreduce_latency_us", "tp_efficiency")
ROUNDS = ((0.5, 0.7, 1.4, 2.0), (0.8, 0.9, 1.1, 1.25), (0.95, 1.05))


def subsample(points: Sequence[ServingPoint], k: int = MAX_FIT_POINTS) -> list[ServingPoint]:
    """At most k points spread evenly over the group (sorted by id, so deterministic)."""
    pts = sorted(points, key=lambda p: p.id)
    if len(pts) <= k:
        return pts
    return [pts[int(i * len(pts) / k)] for i in range(k)]


def spec_of(params: dict[str, float]) -> LatencySpec:
    return LatencySpec.model_validate({"step_overhead_ms": STEP_OVERHEAD_MS, **params})


def loss(points: Sequence[ServingPoint], params: dict[str, float]) -> float:
    spec = spec_of(params)
    total = 0.0
    for p in points:
        pr = predict_point(p, spec, requests=max(2 * p.concurrency, 24))
        if pr.error or not (pr.ttft_ms > 0 and pr.tpot_ms > 0):
            total += 10.0
            continue
        total += abs(math.log(pr.ttft_ms / p.ttft_ms)) + abs(math.log(pr.tpot_ms / p.tpot_ms))
    return total / max(len(points), 1)


def fit_group(points: Sequence[ServingPoint]) -> tuple[dict[str, float], float]:
    """Fitted parameters for the points and the final loss (see module docstring): the better of two
    descents, one with the front end's per-stream share held at 0 and one starting from START's, since a
    descent settles in the nearest valley and the per-stream share moves it to another."""
    pts = subsample(points)
    multi = any(max(p.tp, p.prefill_tp, p.decode_tp) > 1 for p in pts)
    names = [n for n in START if n not in TP_ONLY or multi]
    fits = [_descend(pts, {n: START[n] for n in names} | {"ttft_overhead_us_per_stream": 0.0}),
            _descend(pts, {n: START[n] for n in names})]
    params, best = min(fits, key=lambda f: f[1])
    out = {k: round(v, 4) for k, v in params.items()}
    out["step_overhead_ms"] = STEP_OVERHEAD_MS
    return out, best


def _descend(pts: Sequence[ServingPoint], params: dict[str, float]) -> tuple[dict[str, float], float]:
    """Coordinate descent over multiplicative steps from `params` (a parameter at 0 stays there)."""
    best = loss(pts, params)
    for factors in ROUNDS:
        for name in params:
            lo, hi = BOUNDS[name]
            tried = {params[name]}
            cands = [params[name] * f for f in factors]
            if factors is ROUNDS[0] and lo == 0.0:
                cands.append(0.0)
            for v in cands:
                v = min(hi, max(lo, v))
                if v in tried:
                    continue
                tried.add(v)
                trial = {**params, name: v}
                val = loss(pts, trial)
                if val < best - 1e-9:
                    best, params = val, trial
        logger.info("fit round %s: loss %.4f %s", factors, best, params)
    return params, best
