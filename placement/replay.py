"""`predict --trace`: simulate exactly a trace's requests (their arrivals and lengths) on one given shape, and
print TTFT / TPOT p50/p90/p99 and SLO attainment beside what the trace measured, where it did.

The shape: colocated (instances x TP) or disaggregated (prefill instances x TP x PP, decode instances x TP x
PP). The latency model comes from the catalog (model, hardware, dtypes) with the coefficients and settings of a
planner config when one is given (`--config`, e.g. manifests/plan-distserve-opt13b.yaml: DistServe's own fitted
OPT-13B coefficients), and the engine's scheduler from `backend`. Open loop: each request is sent at its
own arrival time, as the trace's client sent it.
"""

from __future__ import annotations

from typing import Any

from placement.calibration import SCHEDULERS
from placement.catalog import get_hardware, get_model
from placement.config import LatencySpec
from placement.errors import PlacementError, UnknownNameError
from placement.latency import LatencyModel
from placement.packing import pack_nodes
from placement.planner import GroupedDispatch
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.trace import TraceRequest, figures, measured_figures


def replay(trace: list[TraceRequest], *, model: str, hardware: str, weight_dtype: str = "bf16",
           kv_dtype: str = "bf16", mode: str = "disaggregated", instances: int = 1, tp: int = 1,
           prefill_instances: int = 1, prefill_tp: int = 1, decode_instances: int = 1, decode_tp: int = 1,
           prefill_pp: int = 1, decode_pp: int = 1, latency: LatencySpec | None = None, backend: str = "vllm",
           max_prefill_tokens: int | None = None,
           first_token_from_prefill: bool = False, ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.1,
           ) -> dict[str, Any]:
    if backend not in SCHEDULERS:
        raise UnknownNameError("backend", backend, list(SCHEDULERS))
    if ttft_slo_s <= 0 or tpot_slo_s <= 0:
        raise PlacementError(f"SLO targets must be > 0, got TTFT {ttft_slo_s} s and TPOT {tpot_slo_s} s")
    if mode == "colocated" and (prefill_pp, decode_pp) != (1, 1):
        raise PlacementError("--prefill-pp / --decode-pp go with --mode disaggregated (the colocated engine is "
                             "simulated at pp=1)")
    sched = SCHEDULERS[backend]
    budget = max_prefill_tokens or sched.max_batched_tokens
    spec = latency or LatencySpec(calibration=None if backend == "none" else backend)
    m, hw = get_model(model), get_hardware(hardware)
    longest = max(r.input_len + r.output_len for r in trace)

    def lat_for(t: int, pp: int = 1, lanes: int = 1) -> LatencyModel:
        if t < 1 or m.heads % t:
            raise PlacementError(f"tp={t} must be >= 1 and divide {m.name}'s {m.heads} attention heads")
        if pp < 1 or pp > m.layers:
            raise PlacementError(f"pp={pp} must be between 1 and {m.name}'s {m.layers} layers")
        lat = LatencyModel.from_catalog(m, hw, tp=t, pp=pp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, spec=spec)
        room = lat.kv_capacity_tokens() // lanes  # NOTE: a pp decode instance runs pp lanes, each its share
        if room < longest:
            raise PlacementError(f"{m.name} at tp={t} pp={pp} on {hw.name} leaves KV room for {room} tokens per "
                                 f"micro-batch, less than the trace's longest request ({longest})")
        return lat

    reqs = [r.request for r in trace]
    if mode == "colocated":
        if instances < 1:
            raise PlacementError(f"--instances {instances} must be >= 1")
        lat = lat_for(tp)
        res = simulate_colocated(lat, instances, reqs, max_prefill_tokens=budget, chunked_prefill=sched.chunked_prefill)
        shape: dict[str, Any] = {"instances": instances, "tp": tp, "gpus": instances * tp}
    elif mode == "disaggregated":
        if prefill_instances < 1 or decode_instances < 1:
            raise PlacementError("--prefill-instances and --decode-instances must be >= 1")
        lp, ld = lat_for(prefill_tp, prefill_pp), lat_for(decode_tp, decode_pp, decode_pp)
        _, pg, dg = pack_nodes(prefill_instances, lp.gpus, decode_instances, ld.gpus, hw.gpus_per_node)
        res = simulate_disaggregated(lp, ld, prefill_instances, decode_instances, reqs,
                                     dispatch=GroupedDispatch(pg, dg), same_node=lambda a, b: pg[a] == dg[b],
                                     max_prefill_tokens=budget, first_token_from_prefill=first_token_from_prefill)
        shape = {"prefill": {"instances": prefill_instances, "tp": prefill_tp, "pp": prefill_pp},
                 "decode": {"instances": decode_instances, "tp": decode_tp, "pp": decode_pp},
                 "gpus": prefill_instances * lp.gpus + decode_instances * ld.gpus}
    else:
        raise PlacementError(f"--mode {mode!r}: use colocated or disaggregated")
    recs = res.records
    served = [not r.rejected for r in recs]
    predicted = figures([r.ttft_s if ok else None for r, ok in zip(recs, served, strict=True)],
                        [r.tpot_s if ok else None for r, ok in zip(recs, served, strict=True)],
                        [r.output_len for r in recs], ttft_slo_s, tpot_slo_s)
    span = max(r.arrival_s for r in trace)
    return {"mode": mode, **shape, "backend": backend, "requests": len(trace), "rejected": res.rejected,
            "rate_rps": round((len(trace) - 1) / span, 4) if span > 0 else None,
            "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
            "predicted": predicted, "measured": measured_figures(trace, ttft_slo_s, tpot_slo_s),
            "per_request": [{"ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for r in recs]}


def format_replay(p: dict[str, Any]) -> str:
    slo = p["slo"]
    lines = [f"{p['mode']} on {p['gpus']} GPU(s) ({p['backend']}), {p['requests']} requests replayed "
             f"(~{p['rate_rps']} req/s), {p['rejected']} rejected; SLO TTFT {slo['ttft_s'] * 1e3:.0f} ms, "
             f"TPOT {slo['tpot_s'] * 1e3:.0f} ms",
             f"{'':18}{'predicted':>28}" + (f"{'measured':>28}" if p["measured"] else "")]
    for key, name, unit in (("ttft_s", "TTFT p50/p90/p99", 1e3), ("tpot_s", "TPOT p50/p90/p99", 1e3)):
        row = f"{name:18}"
        for side in ("predicted", "measured"):
            if p[side]:
                f = p[side][key]
                row += f"{f['p50'] * unit:>10.1f}{f['p90'] * unit:>9.1f}{f['p99'] * unit:>9.1f}"
        lines.append(row + "  ms")
    att = f"{'attainment':18}{p['predicted']['attainment']:>28.3f}"
    if p["measured"]:
        att += f"{p['measured']['attainment']:>28.3f}"
    lines.append(att)
    return "\n".join(lines)
