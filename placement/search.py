"""Goodput search: the highest arrival rate a configuration serves within the SLO, and DistServe's
placement algorithms over the candidate parallel configurations.

- `max_goodput`: binary search on rate with common random numbers (same lengths and unit arrival gaps
  at every probe), so attainment is (near) monotone in rate.
- Algorithm 1 (high node affinity): prefill and decode configs chosen independently, each by goodput
  per GPU from a single-instance simulation of its own phase.
- Algorithm 2 (low node affinity): prefill and decode segments of a pipeline stage share a node, so KV
  moves over NVLink; a unit is `pp` nodes each holding n_p prefill and n_d decode segments.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from placement.config import SLOSpec
from placement.latency import LatencyModel
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.workload import Workload, remote_prompts

logger = logging.getLogger(__name__)

MAX_DECODE_REQUESTS = 2000


class Goodput(NamedTuple):
    """Highest rate meeting the attainment target (0 if none), and the attainment at the lightest probe."""

    rate_rps: float
    attainment: float
    best_attainment: float
    gpus: int

    @property
    def per_gpu(self) -> float:
        return self.rate_rps / self.gpus


@dataclass(frozen=True)
class PhaseChoice:
    lat: LatencyModel
    goodput: Goodput


def max_goodput(attain: Callable[[float], float], target: float, hi_guess: float, gpus: int,
                iterations: int = 8) -> Goodput:
    """Bracket then bisect the highest rate with attain(rate) >= target."""
    lo_rate = hi_guess * 0.02
    light = attain(lo_rate)
    if light < target:
        return Goodput(0.0, 0.0, light, gpus)
    lo, lo_att = lo_rate, light
    hi = hi_guess
    for _ in range(8):
        a = attain(hi)
        if a < target:
            break
        lo, lo_att, hi = hi, a, hi * 2
    else:
        return Goodput(lo, lo_att, light, gpus)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        a = attain(mid)
        if a >= target:
            lo, lo_att = mid, a
        else:
            hi = mid
    return Goodput(lo, lo_att, light, gpus)


def prefill_capacity(lat: LatencyModel, wl: Workload, max_tokens: int) -> float:
    per_batch = max(1, int(max_tokens // max(wl.mean_input, 1.0)))
    t = lat.prefill_time_s([int(wl.mean_input)] * per_batch)
    return per_batch * lat.pp / t


def decode_capacity(lat: LatencyModel, wl: Workload, tpot_s: float) -> float:
    need = wl.mean_input + wl.mean_output
    lane_cap = lat.kv_capacity_tokens() / lat.pp
    batch = max(1, int(lane_cap // need))
    ctx = int(batch * (wl.mean_input + wl.mean_output / 2))
    step = lat.decode_step_time_s(batch, ctx)
    while batch > 1 and step > tpot_s:
        batch = max(1, batch * 3 // 4)
        step = lat.decode_step_time_s(batch, int(batch * (wl.mean_input + wl.mean_output / 2)))
    return lat.pp * batch / step / max(wl.mean_output, 1.0)


def prefill_goodput(lat: LatencyModel, wl: Workload, slo: SLOSpec, max_tokens: int, same_node: bool,
                    local_tokens: int = 0, first_token_from_prefill: bool = False) -> Goodput:
    """Prefill-only goodput in requests per second of the whole workload; prompts of at most `local_tokens`
    tokens are prefilled on their decode worker, so this instance sees only the longer ones. TTFT ends at the
    prefill with `first_token_from_prefill`, else after the KV transfer too."""
    def attain(rate: float) -> float:
        reqs = remote_prompts(wl.at_rate(rate), local_tokens)
        if not reqs:
            return 1.0
        res = simulate_disaggregated(lat, lat, 1, 1, reqs, mode="prefill", max_prefill_tokens=max_tokens,
                                     same_node=same_node, first_token_from_prefill=first_token_from_prefill)
        return res.attainment(slo.ttft_s, math.inf)

    return max_goodput(attain, slo.attainment, prefill_capacity(lat, wl, max_tokens) / max(wl.remote_share(local_tokens), 0.05), lat.gpus)


def decode_goodput(lat: LatencyModel, wl: Workload, slo: SLOSpec,
                   workload_for: Callable[[int], Workload] | None = None, local_tokens: int = 0) -> Goodput:
    """Decode-only goodput. The probe needs several times the instance's KV concurrency in requests,
    or a large instance never saturates; `workload_for(n)` supplies a bigger sample (capped at
    MAX_DECODE_REQUESTS), and the result is clamped to the analytic KV/TPOT-bound capacity. Prompts of at
    most `local_tokens` tokens are prefilled on this instance among its streams (pp=1 only) and must meet
    the TTFT target too."""
    local = local_tokens if lat.pp == 1 else 0
    cap = decode_capacity(lat, wl, slo.tpot_s)
    concurrency = lat.kv_capacity_tokens() / max(wl.mean_input + wl.mean_output, 1.0)
    want = min(MAX_DECODE_REQUESTS, int(4 * concurrency))
    if workload_for is not None and want > len(wl):
        wl = workload_for(want)

    def attain(rate: float) -> float:
        res = simulate_disaggregated(lat, lat, 1, 1, wl.at_rate(rate), mode="decode", local_prefill_tokens=local)
        if not local:
            return res.attainment(math.inf, slo.tpot_s)
        # NOTE: a local prefill's TTFT is this instance's: judged here; the remote ones' in prefill_goodput
        ok = sum(1 for r in res.records if not r.rejected and r.tpot_s <= slo.tpot_s
                 and (r.input_len > local or r.ttft_s <= slo.ttft_s))
        return ok / max(len(res.records), 1)

    g = max_goodput(attain, slo.attainment, cap, lat.gpus)
    return g._replace(rate_rps=min(g.rate_rps, cap))


def colocated_goodput(lat: LatencyModel, wl: Workload, slo: SLOSpec, max_tokens: int,
                      chunked_prefill: bool = False) -> Goodput:
    def attain(rate: float) -> float:
        res = simulate_colocated(lat, 1, wl.at_rate(rate), max_prefill_tokens=max_tokens,
                                 chunked_prefill=chunked_prefill)
        return res.attainment(slo.ttft_s, slo.tpot_s)

    cp, cd = prefill_capacity(lat, wl, max_tokens), decode_capacity(lat, wl, slo.tpot_s)
    return max_goodput(attain, slo.attainment, 1.0 / (1.0 / cp + 1.0 / cd), lat.gpus)


def best_by_per_gpu(choices: list[PhaseChoice]) -> PhaseChoice:
    """Highest goodput per GPU; ties (and all-zero) broken by attainment, then fewer GPUs."""
    return max(choices, key=lambda c: (round(c.goodput.per_gpu, 9), c.goodput.best_attainment, -c.lat.gpus))


class Unit(NamedTuple):
    """Algorithm 2 unit: one node holding n_prefill prefill and n_decode decode instances."""

    prefill: PhaseChoice
    decode: PhaseChoice
    n_prefill: int
    n_decode: int
    goodput_rps: float

    @property
    def gpus(self) -> int:
        return self.n_prefill * self.prefill.lat.gpus + self.n_decode * self.decode.lat.gpus

    @property
    def per_gpu(self) -> float:
        return self.goodput_rps / self.gpus


def best_units(prefill: list[PhaseChoice], decode: list[PhaseChoice], gpus_per_node: int,
               ratios: bool = False) -> list[Unit]:
    """Node-local units sorted best goodput-per-GPU first. DistServe's algorithm 2 pairs one prefill
    with one decode instance (`ratios=False`); `ratios=True` also tries n_p:n_d mixes that fit a node."""
    units: list[Unit] = []
    for p in prefill:
        for d in decode:
            g_p, g_d = p.lat.gpus, d.lat.gpus
            for n_p in range(1, (gpus_per_node // g_p if ratios else 1) + 1):
                for n_d in range(1, ((gpus_per_node - n_p * g_p) // g_d if ratios else 1) + 1):
                    if n_p * g_p + n_d * g_d > gpus_per_node:
                        continue
                    rate = min(n_p * p.goodput.rate_rps, n_d * d.goodput.rate_rps)
                    units.append(Unit(p, d, n_p, n_d, rate))
    units.sort(key=lambda u: (-round(u.per_gpu, 9), -min(u.prefill.goodput.best_attainment,
                                                          u.decode.goodput.best_attainment), u.gpus))
    return units
