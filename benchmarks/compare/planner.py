"""The placement planner's prediction for a deployment, on exactly the requests a step sends, and its
error against what was measured.

``placement.simulator`` with a measured latency profile simulates a colocated or disaggregated
deployment (sizes from its deploy config) on the step's requests; the figures use the benchmark's own
definitions (``sim_summary``) so predicted and measured compare like for like."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.compare.fmt import fmt_key, fmt_ms, fmt_pct, fmt_rel, md_table
from benchmarks.compare.metrics import ratio
from benchmarks.compare.traffic import Step, request_stats
from benchmarks.stats import SLO, LatencySummary

PLANNER_KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "attainment", "goodput_rps")

Predictions = dict[str, dict[float | str, dict[str, Any]]]
"""variant name -> step key -> ``sim_summary``."""


def sim_summary(records: Sequence[Any], ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    """Predicted figures from simulator records (``placement.sim_result.RequestRecord``), with the
    benchmark's definitions: nearest-rank percentiles, attainment over all requests, goodput = met
    requests / (first arrival to last finish)."""
    done = [r for r in records if not r.rejected]
    ttft = LatencySummary.of([r.ttft_s for r in done])
    tpot = LatencySummary.of([r.tpot_s for r in done])
    met = [r for r in done if r.ttft_s <= ttft_slo and r.tpot_s <= tpot_slo]
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in records)) if done else 0.0
    return {
        "requests": len(records), "rejected": len(records) - len(done),
        "ttft_p50": ttft.p50, "ttft_p90": ttft.p90, "ttft_p99": ttft.p99,
        "tpot_p50": tpot.p50, "tpot_p90": tpot.p90, "tpot_p99": tpot.p99,
        "attainment": len(met) / len(records) if records else 0.0,
        "goodput_rps": len(met) / span if span > 0 else 0.0,
    }


def prediction_error(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    """Absolute (predicted - measured) and relative ((predicted - measured) / measured) error."""
    if predicted is None or measured is None:
        return {"abs": None, "rel": None}
    return {"abs": predicted - measured, "rel": ratio(predicted - measured, measured) if measured else None}


def predict_config(latency: Any, config: Mapping[str, Any], requests: Sequence[Any], slo: SLO
                   ) -> dict[str, Any] | None:
    """``sim_summary`` of the deployment ``config`` describes (a deploy-config dict) serving
    ``requests`` (``placement.workload.Request``); None when its pools are chosen at deploy time."""
    from cluster.config import parse_config
    from placement.simulator import simulate_colocated, simulate_disaggregated

    cfg = parse_config(dict(config))
    if cfg.pools == "auto":
        return None
    if cfg.mode == "colocated":
        sim = simulate_colocated(latency, cfg.pools.colocated, requests)
    else:
        sim = simulate_disaggregated(latency, latency, cfg.pools.prefill, cfg.pools.decode, requests,
                                     same_node=True)
    return sim_summary(sim.records, slo.ttft_s, slo.tpot_s)


def predict_steps(profile: str | Path, configs: Mapping[str, Mapping[str, Any]], steps: Sequence[Step],
                  slo: SLO) -> tuple[Predictions, dict[float | str, dict[str, float]]]:
    """The planner's prediction for each variant (name -> deploy config) and step, on exactly the
    requests each step sends; and per step how many requests that is, their mean lengths, last arrival."""
    from placement.latency import LatencyModel
    from placement.workload import Request

    lat = LatencyModel.from_profile(profile)
    pred: Predictions = {name: {} for name in configs}
    lens: dict[float | str, dict[str, float]] = {}
    for step in steps:
        specs = step.traffic.requests(step.rate)
        reqs = [Request(s.arrival_s, s.input_len, s.output_len) for s in specs]
        lens[step.key] = request_stats(specs)
        for name, config in configs.items():
            p = predict_config(lat, config, reqs, slo)
            if p is not None:
                pred[name][step.key] = p
    return pred, lens


def planner_rows(predicted: Predictions, measured: Mapping[str, Mapping[float | str, dict[str, Any]]],
                 names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per (step, variant): predicted, measured and error of each of ``PLANNER_KEYS``, sorted by step
    key then by ``names`` (default: the order of ``predicted``).

    ``predicted[name][key]`` is a ``sim_summary``, ``measured[name][key]`` a ``metrics_of`` dict. The
    row's ``rate`` is the step key and ``mode`` the variant name."""
    order = list(names if names is not None else predicted)
    rows = []
    for name in order:
        for key in sorted(set(predicted.get(name, {})) & set(measured.get(name, {}))):
            p, m = predicted[name][key], measured[name][key]
            rows.append({"rate": key, "mode": name,
                         "predicted": {k: p.get(k) for k in PLANNER_KEYS},
                         "measured": {k: m.get(k) for k in PLANNER_KEYS},
                         "error": {k: prediction_error(p.get(k), m.get(k)) for k in PLANNER_KEYS}})
    return sorted(rows, key=lambda r: (r["rate"], order.index(r["mode"])))


def planner_table(rows: Sequence[dict[str, Any]]) -> str:
    """Predicted vs measured, with the relative error (attainment: the difference in points)."""
    body = []
    for r in rows:
        p, m, e = r["predicted"], r["measured"], r["error"]
        cells = [fmt_key(r["rate"]), r["mode"]]
        for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
            cells.append(f"{fmt_ms(p[k])} vs {fmt_ms(m[k])} ({fmt_rel(e[k]['rel'])})")
        att = e["attainment"]["abs"]
        cells.append(f"{fmt_pct(p['attainment'])} vs {fmt_pct(m['attainment'])} "
                     f"({'-' if att is None else f'{att * 100:+.0f} pt'})")
        cells.append(f"{p['goodput_rps']:.3f} vs {m['goodput_rps']:.3f} ({fmt_rel(e['goodput_rps']['rel'])})")
        body.append(cells)
    return md_table(["rate", "mode", "TTFT p50 ms pred vs meas (err)", "TTFT p90", "TPOT p50", "TPOT p90",
                     "attainment", "goodput req/s"], body)
