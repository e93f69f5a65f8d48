"""`predict`: the simulator's prediction for one given deployment shape under a fixed workload,
open loop (Poisson at a rate) or closed loop (C clients, each sending its next request when the
last one finishes).

A closed loop is measured in its steady state, as benchmarks report it: the clients' first requests
are spread at random over one request's expected duration (not a burst of C arrivals at t=0, which
would keep the clients in lock step with fixed lengths), and the first C requests (the ramp) are left
out of the figures. The figures include the mean, which benchmarks report as "TTFT"/"TPOT". `backend` picks the engine's scheduler (chunked prefill or not, token budget) and its fitted
efficiencies (placement.calibration).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from placement.calibration import SCHEDULERS
from placement.catalog import get_hardware, get_model
from placement.config import LatencySpec, LengthDist, WorkloadSpec
from placement.errors import PlacementError, UnknownNameError
from placement.latency import LatencyModel
from placement.packing import pack_nodes
from placement.planner import GroupedDispatch
from placement.sim_result import SimResult
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.workload import Workload

logger = logging.getLogger(__name__)


def steady_ramp_s(lat: LatencyModel, isl: int, osl: int, clients: int) -> float:
    """One request's expected duration at `clients` concurrency: the spread of the clients' first sends."""
    ttft = lat.prefill_time_s([isl]) + lat.request_overhead(isl)
    tpot = lat.decode_step_time_s(clients, clients * (isl + osl // 2))
    return ttft + max(osl - 1, 0) * tpot


def client_starts(ramp_s: float, clients: int, seed: int) -> list[float]:
    """First-send times of the clients, uniform over one request's duration: random phases, as a real
    closed loop drifts into (clients that start in lock step stay in lock step with fixed lengths)."""
    return [float(x) for x in np.random.default_rng([seed, 7]).uniform(0.0, ramp_s, clients)]


def predict(*, model: str, hardware: str, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
            mode: str = "disaggregated", instances: int = 1, tp: int = 1, prefill_instances: int = 1,
            prefill_tp: int = 1, decode_instances: int = 1, decode_tp: int = 1, prefill_pp: int = 1,
            decode_pp: int = 1, isl: int = 1024,
            osl: int = 128, concurrency: int | None = None, rate: float | None = None,
            requests: int | None = None, profile: str | None = None, seed: int = 0,
            latency: LatencySpec | None = None, max_prefill_tokens: int | None = None,
            backend: str = "vllm", local_prefill_tokens: int = 0,
            first_token_from_prefill: bool = False) -> dict[str, Any]:
    if (concurrency is None) == (rate is None):
        raise PlacementError("give exactly one of --concurrency C (closed loop) or --rate R (open loop)")
    if concurrency is not None and concurrency < 1:
        raise PlacementError(f"--concurrency {concurrency} must be >= 1")
    if rate is not None and rate <= 0:
        raise PlacementError(f"--rate {rate} must be > 0 req/s")
    if local_prefill_tokens < 0 or (local_prefill_tokens and mode != "disaggregated"):
        raise PlacementError(f"--local-prefill-tokens {local_prefill_tokens}: give >= 0, with --mode disaggregated "
                             f"(a colocated engine prefills every prompt itself)")
    if first_token_from_prefill and mode != "disaggregated":
        raise PlacementError("--first-token-from-prefill needs --mode disaggregated (a colocated engine has no "
                             "KV transfer)")
    if mode == "colocated" and (prefill_pp, decode_pp) != (1, 1):
        raise PlacementError("--prefill-pp / --decode-pp go with --mode disaggregated (the colocated engine is "
                             "simulated at pp=1)")
    if isl < 1 or osl < 1:
        raise PlacementError(f"--isl {isl} and --osl {osl} must be >= 1 token")
    for name, v in (("instances", instances), ("tp", tp), ("prefill-instances", prefill_instances),
                    ("prefill-tp", prefill_tp), ("decode-instances", decode_instances), ("decode-tp", decode_tp),
                    ("prefill-pp", prefill_pp), ("decode-pp", decode_pp)):
        if v < 1:
            raise PlacementError(f"--{name} {v} must be >= 1")
    if local_prefill_tokens and decode_pp > 1:
        raise PlacementError(f"--local-prefill-tokens with --decode-pp {decode_pp}: local prefill is modelled on "
                             "pp=1 decode instances only")
    if backend not in SCHEDULERS:
        raise UnknownNameError("backend", backend, list(SCHEDULERS))
    sched = SCHEDULERS[backend]
    budget = max_prefill_tokens or sched.max_batched_tokens
    spec = latency or LatencySpec(calibration=None if backend == "none" else backend)
    hw = get_hardware(hardware) if profile is None else None

    def lat_for(t: int, pp: int = 1, lanes: int = 1) -> LatencyModel:
        if profile is not None:
            return LatencyModel.from_profile(profile)
        assert hw is not None
        m = get_model(model)
        if m.heads % t:
            raise PlacementError(f"tp={t} does not divide {m.name}'s {m.heads} attention heads")
        lat = LatencyModel.from_catalog(m, hw, tp=t, pp=pp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                        spec=spec)
        if lat.kv_capacity_tokens() // lanes < isl + osl:  # NOTE: a pp decode instance: pp lanes, each a share
            raise PlacementError(f"{m.name} in {weight_dtype} at tp={t} on {hw.name} leaves KV room for "
                                 f"{lat.kv_capacity_tokens()} tokens, less than one {isl + osl}-token request; "
                                 f"raise tp or use fp8")
        return lat

    warm = concurrency or 0
    n = requests or (max(400, 4 * concurrency) if concurrency else 500)
    wspec = WorkloadSpec(input=LengthDist(kind="fixed", value=isl), output=LengthDist(kind="fixed", value=osl))
    reqs = Workload.from_spec(wspec, n + warm, seed).at_rate(rate if rate else 1.0)
    gpn = hw.gpus_per_node if hw is not None else 1
    res: SimResult
    if mode == "colocated":
        lat = lat_for(tp)
        ramp = client_starts(steady_ramp_s(lat, isl, osl, concurrency), concurrency, seed) if concurrency else 0.0
        res = simulate_colocated(lat, instances, reqs, clients=concurrency, max_prefill_tokens=budget,
                                 chunked_prefill=sched.chunked_prefill, ramp_s=ramp)
        shape: dict[str, Any] = {"instances": instances, "tp": tp, "gpus": instances * tp}
    elif mode == "disaggregated":
        lp, ld = lat_for(prefill_tp, prefill_pp), lat_for(decode_tp, decode_pp, decode_pp)
        ramp = client_starts(steady_ramp_s(ld, isl, osl, concurrency), concurrency, seed) if concurrency else 0.0
        _, pg, dg = pack_nodes(prefill_instances, lp.gpus, decode_instances, ld.gpus, gpn)
        res = simulate_disaggregated(lp, ld, prefill_instances, decode_instances, reqs, clients=concurrency,
                                     dispatch=GroupedDispatch(pg, dg), same_node=lambda a, b: pg[a] == dg[b],
                                     max_prefill_tokens=budget, ramp_s=ramp,
                                     local_prefill_tokens=local_prefill_tokens,
                                     first_token_from_prefill=first_token_from_prefill)
        shape = {"prefill": {"instances": prefill_instances, "tp": prefill_tp, "pp": prefill_pp},
                 "decode": {"instances": decode_instances, "tp": decode_tp, "pp": decode_pp},
                 "gpus": prefill_instances * lp.gpus + decode_instances * ld.gpus}
    else:
        raise PlacementError(f"--mode {mode!r}: use colocated or disaggregated")
    if warm:
        res = SimResult(res.records[warm:], res.policy_rejected)
    ttft, tpot = res.ttft(), res.tpot()
    return {
        "mode": mode, **shape, "backend": backend, "isl": isl, "osl": osl, "concurrency": concurrency,
        "rate_rps": rate, "requests": res.total, "completed": res.completed, "rejected": res.rejected,
        "ttft_s": {k: round(v, 6) for k, v in ttft._asdict().items()},
        "tpot_s": {k: round(v, 6) for k, v in tpot._asdict().items()},
        "throughput_tok_s": round(res.output_tok_s(), 3), "input_tok_s": round(res.input_tok_s(), 3),
        "requests_per_s": round(res.requests_per_s(), 4),
    }


def format_prediction(p: dict[str, Any]) -> str:
    load = f"closed loop, {p['concurrency']} clients" if p["concurrency"] else f"open loop, {p['rate_rps']} req/s"
    t, o = p["ttft_s"], p["tpot_s"]
    return "\n".join([
        f"{p['mode']} on {p['gpus']} GPU(s) ({p['backend']}), ISL {p['isl']} / OSL {p['osl']}, {load}, "
        f"{p['requests']} requests",
        f"TTFT p50/p90/p99  {t['p50'] * 1e3:.1f} / {t['p90'] * 1e3:.1f} / {t['p99'] * 1e3:.1f} ms",
        f"TPOT p50/p90/p99  {o['p50'] * 1e3:.2f} / {o['p90'] * 1e3:.2f} / {o['p99'] * 1e3:.2f} ms",
        f"throughput        {p['throughput_tok_s']:.1f} output tok/s, {p['requests_per_s']:.3f} req/s "
        f"({p['rejected']} rejected)",
    ])
