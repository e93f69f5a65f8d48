"""Colocated vs disaggregated, from the measurements: rows side by side per rate, the goodput ratio and
winner, steps disturbed by other people's processes, the same records re-judged at other TPOT targets,
and plain findings. Pure (unit-tested, no Ray)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.compare.fmt import fmt_ms, fmt_ratio
from benchmarks.compare.metrics import metrics_of, ratio, slo_capacity
from benchmarks.compare.quiet import disturbed
from benchmarks.compare.shapes import MODES, SHORT

Resources = dict[str, dict[float, dict[str, Any]]]
"""mode -> rate -> a step's resources (``benchmarks.compare.step.measure_step``)."""


def side_by_side(colocated: Sequence[dict[str, Any]], disaggregated: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rate (in colocated's order) from two lists of ``RateSummary`` dicts matched by rate.

    Each row: ``rate``, ``colocated`` and ``disaggregated`` (``metrics_of``), ``goodput_ratio``
    (disaggregated / colocated goodput), ``attainment_delta`` (disaggregated - colocated) and
    ``winner`` ("disaggregated", "colocated" or "tie" on goodput)."""
    by_rate = {d["rate"]: d for d in disaggregated}
    if len(by_rate) != len(disaggregated) or len({c["rate"] for c in colocated}) != len(colocated):
        raise ValueError("each rate must appear once per mode")
    if set(by_rate) != {c["rate"] for c in colocated}:
        raise ValueError(f"the modes ran different rates: colocated {[c['rate'] for c in colocated]}, "
                         f"disaggregated {[d['rate'] for d in disaggregated]}")
    rows = []
    for c in colocated:
        mc, md = metrics_of(c), metrics_of(by_rate[c["rate"]])
        gc, gd = mc["goodput_rps"], md["goodput_rps"]
        winner = "tie" if math.isclose(gc, gd, rel_tol=1e-9, abs_tol=1e-12) else (
            "disaggregated" if gd > gc else "colocated")
        rows.append({"rate": c["rate"], "colocated": mc, "disaggregated": md, "goodput_ratio": ratio(gd, gc),
                     "attainment_delta": md["attainment"] - mc["attainment"], "winner": winner})
    return rows


def foreign_load(resources: Resources, limit: float, steal_limit: float | None = None) -> dict[str, Any]:
    """Steps during which processes that are not ours used more than ``limit`` cores (shared box), or the host
    took more than ``steal_limit`` (steal; None: runs from before it was checked), of every variant in
    ``resources``."""
    stolen = math.inf if steal_limit is None else steal_limit
    flagged = sorted({rate for m in resources for rate, res in resources[m].items()
                      if disturbed(res, limit, stolen)})
    worst = {f"{m} {rate:g}": res.get("machine_other_cores") for m in resources
             for rate, res in sorted(resources[m].items()) if disturbed(res, limit, math.inf)}
    out: dict[str, Any] = {"limit_cores": limit, "rates": flagged, "steps": worst}
    if steal_limit is not None:
        out["steal_limit_cores"] = steal_limit
        out["steal_steps"] = {f"{m} {rate:g}": res["machine_steal_cores"] for m in resources
                              for rate, res in sorted(resources[m].items())
                              if disturbed(res, math.inf, steal_limit)}
    return out


def slo_sweep(records: dict[str, dict[float, list[dict[str, Any]]]], durations: dict[str, dict[float, float]],
              ttft_s: float, tpot_targets: Sequence[float]) -> list[dict[str, Any]]:
    """Attainment and goodput of every (rate, mode) re-judged at each TPOT target (TTFT target fixed),
    from the stored per-request records (``RequestRecord`` dicts)."""
    from benchmarks.client import RequestRecord
    from benchmarks.stats import SLO, meets_slo

    out = []
    rates = sorted(set.intersection(*(set(records[m]) for m in MODES)))
    for tpot in tpot_targets:
        slo = SLO(ttft_s, tpot)
        for rate in rates:
            row: dict[str, Any] = {"tpot_s": tpot, "rate": rate}
            for mode in MODES:
                recs = [RequestRecord(**r) for r in records[mode][rate]]
                met = sum(meets_slo(r, slo) for r in recs)
                row[mode] = {"attainment": met / len(recs) if recs else 0.0,
                             "goodput_rps": met / durations[mode][rate]}
            row["goodput_ratio"] = ratio(row["disaggregated"]["goodput_rps"], row["colocated"]["goodput_rps"])
            out.append(row)
    return out


def findings(rows: Sequence[dict[str, Any]], resources: Resources, slo: dict[str, float],
             target: float) -> list[str]:
    """Plain statements computed from the measurements: where each mode won, where colocated
    missed the SLO and disaggregated did not, and the mechanisms (batch per engine, CPU per role)."""
    out = []
    rates = [r["rate"] for r in rows]
    caps = {m: slo_capacity(rates, [r[m]["attainment"] for r in rows], target) for m in MODES}
    out.append("highest rate with every tested rate up to it at >= "
               f"{target:.0%} attainment: colocated {caps['colocated'] if caps['colocated'] is not None else 'none'}"
               f" req/s, disaggregated {caps['disaggregated'] if caps['disaggregated'] is not None else 'none'} req/s")
    wins = [r for r in rows if r["winner"] == "disaggregated"]
    losses = [r for r in rows if r["winner"] == "colocated"]

    def listing(rs: Sequence[dict[str, Any]]) -> str:
        return ", ".join(f"{r['rate']:g}" for r in rs) or "none"

    out.append(f"goodput: disaggregated higher at {len(wins)} of {len(rows)} rates ({listing(wins)}), "
               f"colocated higher at {len(losses)} ({listing(losses)})")
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        parts = [f"rate {r['rate']:g}: goodput ratio {fmt_ratio(r['goodput_ratio'])}; "
                 f"TTFT p90 {fmt_ms(c['ttft_p90'])} -> {fmt_ms(d['ttft_p90'])} ms, "
                 f"TPOT p90 {fmt_ms(c['tpot_p90'])} -> {fmt_ms(d['tpot_p90'])} ms, "
                 f"ITL p99 {fmt_ms(c['itl_p99'])} -> {fmt_ms(d['itl_p99'])} ms (colocated -> disaggregated)"]
        if c["tpot_p90"] is not None and c["tpot_p90"] > slo["tpot_s"] and (
                d["tpot_p90"] is not None and d["tpot_p90"] <= slo["tpot_s"]):
            parts.append(f"colocated misses the {slo['tpot_s'] * 1000:g} ms TPOT target at p90, disaggregated meets it")
        if c["ttft_p90"] is not None and d["ttft_p90"] is not None and d["ttft_p90"] > slo["ttft_s"] >= c["ttft_p90"]:
            parts.append(f"disaggregated misses the {slo['ttft_s']:g} s TTFT target at p90, colocated meets it")
        for mode in MODES:
            res = resources.get(mode, {}).get(r["rate"])
            if res:
                parts.append(resource_finding(mode, res))
        out.append("; ".join(parts))
    return out


def resource_finding(mode: str, res: dict[str, Any]) -> str:
    """One mode's mechanism at one rate: running batch per worker and cores per engine and the rest."""
    batch = ", ".join(f"{w} {v['mean_running_when_busy']:.1f} (busy {v['busy_fraction']:.0%})"
                      for w, v in res.get("workers", {}).items())
    cores = res.get("cpu_cores", {})
    eng = sum(v for k, v in cores.items() if k.startswith("engine "))
    other, steal = res.get("machine_other_cores"), res.get("machine_steal_cores")
    return (f"{SHORT[mode]}: mean running batch when busy {batch or '-'}; cores: engines {eng:.2f} ("
            + ", ".join(f"{k[7:]} {v:.2f}" for k, v in cores.items() if k.startswith("engine "))
            + f"), rest of ours {sum(cores.values()) - eng:.2f}"
            + ("" if other is None else f", not ours {other:.2f}")
            + ("" if steal is None else f", taken by the host (steal) {steal:.2f}"))
