"""What each request's admission came to, what the tokens cost, and how close the router's predictions
were, per mode and rate step: the figures a goodput router is judged by. Pure, computed from the stored
per-request records (so ``--from-raw`` adds them to a run saved before they existed).

- outcome: met both targets / answered but late (what admission should have refused) / refused with 429
  (and how long the refusal took) / failed;
- cost: $/M input and output tokens at the run's $/hour for the whole box (``benchmarks.stats.cost_of``:
  a disaggregated shape splits by engine count, a colocated one by time in prefill vs decode);
- router: predicted / measured TTFT (routing -> first token) and TPOT at p50 and p90 of the served
  requests, from ``step.measure_step``'s ``router_predictions``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.client import RequestRecord
from benchmarks.stats import SLO, CostModel, LatencySummary, cost_of, meets_slo

Records = Mapping[str, Mapping[float, Sequence[dict[str, Any]]]]
"""mode -> rate -> ``RequestRecord`` dicts."""


def outcome(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Counts of met / late / refused / failed requests and the refusals' send -> 429 times (None
    where the records predate timing refusals)."""
    ok = [r for r in records if r.ok]
    met = sum(meets_slo(r, slo) for r in ok)
    refused = [r for r in records if r.status == 429]
    times = LatencySummary.of([r.e2e_s for r in refused if r.e2e_s is not None])
    return {"sent": len(records), "met": met, "late": len(ok) - met, "refused": len(refused),
            "failed": len(records) - len(ok) - len(refused), "refusal_p50_s": times.p50,
            "refusal_max_s": times.max}


def cost_model(shape_pools: Mapping[str, int], dollars_per_hour: float) -> CostModel:
    """The box's $/hour split as ``cost_of`` does for this shape's pools."""
    if "prefill" in shape_pools:
        return CostModel(dollars_per_hour, shape_pools["prefill"], shape_pools["decode"])
    return CostModel(dollars_per_hour)


def outcomes(records: Records, durations: Mapping[str, Mapping[float, float]], slo: dict[str, float],
             shapes: Mapping[str, Mapping[str, Any]], dollars_per_hour: float | None) -> dict[str, dict[float, Any]]:
    """mode -> rate -> ``outcome`` plus ``dollars_per_m_input`` / ``dollars_per_m_output`` and, since
    the two shapes split the box's cost between the phases differently, ``dollars_per_m_tokens`` (input
    and output together, comparable across shapes); None without a price."""
    judge = SLO(slo["ttft_s"], slo["tpot_s"])
    out: dict[str, dict[float, Any]] = {}
    for mode, by_rate in records.items():
        out[mode] = {}
        for rate, raw in by_rate.items():
            recs = [RequestRecord(**r) for r in raw]
            row = outcome(recs, judge)
            cost = None
            if dollars_per_hour is not None and rate in durations.get(mode, {}):
                cost = cost_of(recs, durations[mode][rate], cost_model(shapes[mode]["pools"], dollars_per_hour))
            tokens = sum(r.prompt_tokens + r.completion_tokens for r in recs if r.ok)
            row["dollars_per_m_input"] = cost.dollars_per_m_input if cost else None
            row["dollars_per_m_output"] = cost.dollars_per_m_output if cost else None
            row["dollars_per_m_tokens"] = cost.total_dollars / tokens * 1e6 if cost and tokens else None
            out[mode][rate] = row
    return out


def router_rows(resources: Mapping[str, Mapping[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (rate, mode) with the router's predicted/measured p50 and p90 ratios, where the
    router predicted anything (a baseline policy predicts nothing)."""
    rows = []
    for mode, by_rate in resources.items():
        for rate, res in sorted(by_rate.items()):
            pred = res.get("router_predictions") or {}
            if not pred.get("count"):
                continue
            row = {"rate": rate, "mode": mode, "count": pred["count"]}
            for name in ("ttft", "tpot"):
                p = pred.get(name) or {}
                row[name] = {k: p.get(k) for k in ("p50_predicted", "p50_measured", "p90_predicted",
                                                   "p90_measured", "p50_ratio", "p90_ratio", "log_error_mean",
                                                   "log_error_sd")}
            rows.append(row)
    return sorted(rows, key=lambda r: (r["rate"], r["mode"]))


def within(rows: Sequence[dict[str, Any]], tolerance: float = 0.25) -> dict[str, Any]:
    """How many of the router's p50/p90 ratios lie within ``tolerance`` of 1, per figure."""
    out: dict[str, Any] = {"tolerance": tolerance}
    for name in ("ttft", "tpot"):
        ratios = [r[name][k] for r in rows for k in ("p50_ratio", "p90_ratio") if r[name].get(k) is not None]
        out[name] = {"within": sum(abs(x - 1) <= tolerance for x in ratios), "of": len(ratios)}
    return out
