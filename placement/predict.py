"""`predict`: the simulator's prediction for one given deployment shape under a fixed workload,
open loop (Poisson at a rate) or closed loop (C clients, each sending its next request when the
last one finishes)."""

from __future__ import annotations

import logging
from typing import Any

from placement.catalog import get_hardware, get_model
from placement.config import LatencySpec, LengthDist, WorkloadSpec
from placement.errors import PlacementError
from placement.latency import LatencyModel
from placement.planner import GroupedDispatch, pack_nodes
from placement.sim_result import SimResult
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.workload import Workload

logger = logging.getLogger(__name__)


def predict(*, model: str, hardware: str, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
            mode: str = "disaggregated", instances: int = 1, tp: int = 1, prefill_instances: int = 1,
            prefill_tp: int = 1, decode_instances: int = 1, decode_tp: int = 1, isl: int = 1024,
            osl: int = 128, concurrency: int | None = None, rate: float | None = None,
            requests: int | None = None, profile: str | None = None, seed: int = 0,
            latency: LatencySpec | None = None, max_prefill_tokens: int = 4096) -> dict[str, Any]:
    if (concurrency is None) == (rate is None):
        raise PlacementError("give exactly one of --concurrency C (closed loop) or --rate R (open loop)")
    if concurrency is not None and concurrency < 1:
        raise PlacementError(f"--concurrency {concurrency} must be >= 1")
    if rate is not None and rate <= 0:
        raise PlacementError(f"--rate {rate} must be > 0 req/s")
    if isl < 1 or osl < 1:
        raise PlacementError(f"--isl {isl} and --osl {osl} must be >= 1 token")
    for name, v in (("instances", instances), ("tp", tp), ("prefill-instances", prefill_instances),
                    ("prefill-tp", prefill_tp), ("decode-instances", decode_instances), ("decode-tp", decode_tp)):
        if v < 1:
            raise PlacementError(f"--{name} {v} must be >= 1")
    hw = get_hardware(hardware) if profile is None else None

    def lat_for(t: int) -> LatencyModel:
        if profile is not None:
            return LatencyModel.from_profile(profile)
        assert hw is not None
        m = get_model(model)
        if m.heads % t:
            raise PlacementError(f"tp={t} does not divide {m.name}'s {m.heads} attention heads")
        lat = LatencyModel.from_catalog(m, hw, tp=t, weight_dtype=weight_dtype, kv_dtype=kv_dtype, spec=latency)
        if lat.kv_capacity_tokens() < isl + osl:
            raise PlacementError(f"{m.name} in {weight_dtype} at tp={t} on {hw.name} leaves KV room for "
                                 f"{lat.kv_capacity_tokens()} tokens, less than one {isl + osl}-token request; "
                                 f"raise tp or use fp8")
        return lat

    n = requests or (max(400, 4 * concurrency) if concurrency else 500)
    spec = WorkloadSpec(input=LengthDist(kind="fixed", value=isl), output=LengthDist(kind="fixed", value=osl))
    reqs = Workload.from_spec(spec, n, seed).at_rate(rate if rate else 1.0)
    gpn = hw.gpus_per_node if hw is not None else 1
    res: SimResult
    if mode == "colocated":
        res = simulate_colocated(lat_for(tp), instances, reqs, clients=concurrency,
                                 max_prefill_tokens=max_prefill_tokens)
        shape: dict[str, Any] = {"instances": instances, "tp": tp, "gpus": instances * tp}
    elif mode == "disaggregated":
        lp, ld = lat_for(prefill_tp), lat_for(decode_tp)
        _, pg, dg = pack_nodes(prefill_instances, lp.gpus, decode_instances, ld.gpus, gpn)
        res = simulate_disaggregated(lp, ld, prefill_instances, decode_instances, reqs, clients=concurrency,
                                     dispatch=GroupedDispatch(pg, dg), same_node=lambda a, b: pg[a] == dg[b],
                                     max_prefill_tokens=max_prefill_tokens)
        shape = {"prefill": {"instances": prefill_instances, "tp": prefill_tp, "pp": 1},
                 "decode": {"instances": decode_instances, "tp": decode_tp, "pp": 1},
                 "gpus": prefill_instances * lp.gpus + decode_instances * ld.gpus}
    else:
        raise PlacementError(f"--mode {mode!r}: use colocated or disaggregated")
    ttft, tpot = res.ttft(), res.tpot()
    return {
        "mode": mode, **shape, "isl": isl, "osl": osl, "concurrency": concurrency, "rate_rps": rate,
        "requests": res.total, "completed": res.completed, "rejected": res.rejected,
        "ttft_s": {k: round(v, 6) for k, v in ttft._asdict().items()},
        "tpot_s": {k: round(v, 6) for k, v in tpot._asdict().items()},
        "throughput_tok_s": round(res.output_tok_s(), 3), "input_tok_s": round(res.input_tok_s(), 3),
        "requests_per_s": round(res.requests_per_s(), 4),
    }


def format_prediction(p: dict[str, Any]) -> str:
    load = f"closed loop, {p['concurrency']} clients" if p["concurrency"] else f"open loop, {p['rate_rps']} req/s"
    t, o = p["ttft_s"], p["tpot_s"]
    return "\n".join([
        f"{p['mode']} on {p['gpus']} GPU(s), ISL {p['isl']} / OSL {p['osl']}, {load}, {p['requests']} requests",
        f"TTFT p50/p90/p99  {t['p50'] * 1e3:.1f} / {t['p90'] * 1e3:.1f} / {t['p99'] * 1e3:.1f} ms",
        f"TPOT p50/p90/p99  {o['p50'] * 1e3:.2f} / {o['p90'] * 1e3:.2f} / {o['p99'] * 1e3:.2f} ms",
        f"throughput        {p['throughput_tok_s']:.1f} output tok/s, {p['requests_per_s']:.3f} req/s "
        f"({p['rejected']} rejected)",
    ])
