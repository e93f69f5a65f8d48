"""The colocated vs disaggregated report from what a run measured (raw.json): pure, so ``--from-raw``
rebuilds report.md/json/png from a saved run without deploying anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.compare.analysis import findings, foreign_load, side_by_side, slo_sweep
from benchmarks.compare.metrics import slo_capacity
from benchmarks.compare.outcomes import outcomes, router_rows, within
from benchmarks.compare.planner import planner_rows
from benchmarks.compare.quality_check import quality_summary
from benchmarks.compare.quiet import FOREIGN_LIMIT
from benchmarks.compare.shapes import MODES, QUALITY_SOURCES
from benchmarks.compare.writer import rekey


def load_raw(path: Path) -> dict[str, Any]:
    """raw.json with its rate keys turned back into floats."""
    raw = json.loads(path.read_text())
    raw["pred"] = {m: rekey(v) for m, v in raw["pred"].items()}
    raw["records"] = {m: rekey(v) for m, v in raw["records"].items()}
    for part in raw["parts"].values():
        if "resources" in part:
            part["resources"] = rekey(part["resources"])
    return raw


def assemble(raw: dict[str, Any], dollars_per_hour: float | None = None) -> dict[str, Any]:
    """The full report from what the run measured (``raw``: header, parts, records, predictions,
    quality outputs). ``dollars_per_hour`` (the box's price) overrides the run's own, e.g. for a run
    saved before the price was recorded."""
    report = dict(raw["report"])
    if dollars_per_hour is not None:
        report["dollars_per_hour"] = dollars_per_hour
    parts, records, pred = raw["parts"], raw["records"], raw["pred"]
    rates, slo = report["rates"], report["slo"]
    rows = side_by_side(parts["colocated"]["steps"], parts["disaggregated"]["steps"])
    report["rows"] = rows
    measured = {m: {r["rate"]: r[m] for r in rows} for m in MODES}
    report["planner"] = {"profile": report["profile"], "rows": planner_rows(pred, measured, MODES)}
    parts = {m: dict(p, resources={r: {k: v for k, v in res.items() if k != "samples"}
                                   for r, res in p.get("resources", {}).items()}) for m, p in parts.items()}
    report["resources"] = {m: parts[m]["resources"] for m in MODES}
    report["foreign_load"] = foreign_load(report["resources"], report.get("foreign_limit", FOREIGN_LIMIT),
                                         report.get("steal_limit"))
    report["slo_capacity"] = {m: slo_capacity(rates, [r[m]["attainment"] for r in rows], report["attainment_target"])
                              for m in MODES}
    report["findings"] = findings(rows, report["resources"], slo, report["attainment_target"])
    durations = {m: {r["rate"]: r[m]["duration_s"] for r in rows} for m in MODES}
    report["outcomes"] = outcomes(records, durations, slo, report["shapes"], report.get("dollars_per_hour"))
    for r in rows:
        for m in MODES:
            o = report["outcomes"].get(m, {}).get(r["rate"], {})
            r[m].update({k: o.get(k) for k in ("late", "refused", "refusal_p50_s", "refusal_max_s",
                                               "dollars_per_m_input", "dollars_per_m_output",
                                               "dollars_per_m_tokens")})
    router = router_rows(report["resources"])
    report["router"] = {"rows": router, "within": within(router)}
    report["slo_sweep"] = {"ttft_s": slo["ttft_s"],
                           "rows": slo_sweep(records, durations, slo["ttft_s"], report["tpot_targets"])}
    report["modes"] = parts
    q = raw.get("quality_outputs") or {}
    if q:
        report["quality"] = quality_summary(q, QUALITY_SOURCES, raw.get("offline_error"))
    return report
